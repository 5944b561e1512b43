"""How a cold ``%clorch start`` grows with the rank count (issue 39), beside baselines of the same run.

    python benchmarks/start_scale.py [--nprocs 4,8,16] [--repeats 3] [--iters 100]

For each rank count N, in one notebook kernel (``CLORCH_SPARES=0``: cold starts), alternating
start by start so that a shared machine's load falls on both alike:

* ``%clorch start --nproc N --backend gloo`` until the group has formed, with the ranks forked
  from the session's zygote (``CLORCH_FORK_RANKS=1``, the default) and as fresh interpreters
  (``CLORCH_FORK_RANKS=0``, the way before);
* the baselines: N plain ipykernels started at once by jupyter_client until each answers
  ``kernel_info`` (no torch, no group), and ``torchrun`` starting N gloo ranks (init, barrier, exit);
* an empty ``%%distributed`` cell at N ranks beside ``pass`` in the same notebook kernel
  (interleaved pairs, as ``cell_latency.py`` does), after a forked start.

Prints medians with [min-max] over ``--repeats`` and the 1-minute load average when each rank
count began. Targets (issue 39, on the 16-core device): 64 ranks formed within 10 s; an empty
cell at 64 within 2x a plain kernel's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from queue import Empty

from jupyter_client import KernelManager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cell_latency import interleaved, percentiles, round_trip, torchrun_start  # noqa: E402
from notebook_kernel import NotebookKernel  # noqa: E402  (cell_latency put tests/ on the path)

MODES = {"forked": "1", "fresh interpreters": "0"}


def plain_kernels(n: int) -> float:
    """Seconds until N plain ipykernels started at once all answer kernel_info."""
    t0 = time.perf_counter()
    # IPC sockets, as the ranks have: with TCP, 64 kernels started at once raced for the ports
    # jupyter_client had picked for them (the device: "Address already in use", a kernel died)
    folder = tempfile.mkdtemp(prefix="clorch-plain-")
    managers = [KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, f"k{i}"))
                for i in range(n)]
    try:
        for km in managers:
            km.start_kernel()
        clients = [km.client() for km in managers]
        for client in clients:
            client.start_channels()
        for client in clients:
            client.wait_for_ready(timeout=300)
        elapsed = time.perf_counter() - t0
        for client in clients:
            client.stop_channels()
        return elapsed
    finally:
        for km in managers:
            try:
                km.shutdown_kernel(now=True)
            except (RuntimeError, Empty) as exc:
                print(f"  (a plain kernel did not shut down cleanly: {exc})")
        shutil.rmtree(folder, ignore_errors=True)


def spread(samples: list[float]) -> str:
    return f"{statistics.median(samples):6.2f} s [{min(samples):.2f}-{max(samples):.2f}]"


def clorch_start(nb: NotebookKernel, n: int, fork: str) -> float:
    assert nb.run(f"%env CLORCH_FORK_RANKS={fork}").status == "ok"
    elapsed, status = round_trip(nb, f"%clorch start --nproc {n} --backend gloo")
    assert status == "ok", f"%clorch start --nproc {n} (CLORCH_FORK_RANKS={fork}) failed"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="4,8,16")
    parser.add_argument("--repeats", type=int, default=3, help="starts per mode and baseline, per rank count")
    parser.add_argument("--iters", type=int, default=100, help="pairs of cells for the empty cell (0: none)")
    parser.add_argument("--fresh-max", type=int, default=10**6,
                        help="time fresh interpreters and torchrun (each rank imports torch: about 0.3 GB a "
                             "rank) only up to this many ranks")
    args = parser.parse_args()
    nb = NotebookKernel(env={"CLORCH_SPARES": "0"})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        for n in (int(x) for x in args.nprocs.split(",")):
            load = os.getloadavg()[0]
            heavy = n <= args.fresh_max
            times: dict[str, list[float]] = {name: [] for name in [*MODES, "plain ipykernels", "torchrun"]
                                             if heavy or name in ("forked", "plain ipykernels")}
            for _ in range(args.repeats):
                for name, fork in MODES.items():
                    if name in times:
                        times[name].append(clorch_start(nb, n, fork))
                        nb.run("%clorch stop")
                try:
                    times["plain ipykernels"].append(plain_kernels(n))
                except RuntimeError as exc:  # a baseline that failed: say so, and keep the rest
                    print(f"  (plain ipykernels, {n} at once, failed: {exc})")
                if heavy:
                    times["torchrun"].append(torchrun_start(n, "gloo"))
            print(f"{n} ranks (load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end):")
            for name, samples in times.items():
                if not samples:
                    continue
                label = f"%clorch start, {name}" if name in MODES else name
                print(f"  {label:<38} {spread(samples)}")
            if args.iters:
                clorch_start(nb, n, "1")
                floor, cells = interleaved(nb, args.iters)
                f50, _ = percentiles(floor)
                c50, _ = percentiles(cells)
                print(f"  empty cell p50 {c50:.2f} ms, plain kernel's pass {f50:.2f} ms: {c50 / f50:.2f}x")
                nb.run("%clorch stop")
            sys.stdout.flush()
    finally:
        nb.shutdown()


if __name__ == "__main__":
    main()
