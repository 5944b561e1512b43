"""Round trip of an empty ``%%distributed`` cell as a Jupyter client sees it, beside the floor.

    python benchmarks/cell_latency.py [--iters 200] [--nprocs 2,4]

The floor is the same round trip (execute_request until the kernel reports idle) of a plain
kernel running ``pass``, measured in the same run on the same machine. Also times
``%clorch start`` until the group is ready, beside ``torchrun`` starting the same gloo group.
Prints p50/p90 in milliseconds and the ratios. Target at 2 ranks: p50 within 1.5x the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)


def round_trip(kernel: NotebookKernel, code: str) -> tuple[float, str]:
    """Seconds from execute_request to the idle status of that request, and the reply's status."""
    t0 = time.perf_counter()
    reply = kernel.collect(kernel.send(code), timeout=300)
    return reply.idle_at - t0, reply.status


def percentiles(samples: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(samples, n=10)
    return statistics.median(samples) * 1e3, qs[8] * 1e3


def time_cells(kernel: NotebookKernel, code: str, iters: int) -> list[float]:
    for _ in range(max(5, iters // 10)):  # warm-up
        round_trip(kernel, code)
    samples = []
    for _ in range(iters):
        elapsed, status = round_trip(kernel, code)
        assert status == "ok", status
        samples.append(elapsed)
    return samples


def torchrun_start(nproc: int, backend: str) -> float:
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        if "{backend}" == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("{backend}")
        dist.barrier()
        dist.destroy_process_group()
    """)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(script)
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", fh.name], check=True, capture_output=True)
        return time.perf_counter() - t0
    finally:
        os.unlink(fh.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--backend", default=None, help="passed to %%clorch start (default: its own)")
    args = parser.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]

    kernel = NotebookKernel()
    try:
        floor = time_cells(kernel, "pass", args.iters)
        f50, f90 = percentiles(floor)
        print(f"{'case':<28}{'p50 ms':>9}{'p90 ms':>9}{'p50 ratio':>11}{'p90 ratio':>11}")
        print(f"{'plain kernel: pass (floor)':<28}{f50:>9.2f}{f90:>9.2f}{1:>11.2f}{1:>11.2f}")
        kernel.run("%load_ext clorch_repl")
        starts = {}
        for n in nprocs:
            backend = f" --backend {args.backend}" if args.backend else ""
            elapsed, status = round_trip(kernel, f"%clorch start --nproc {n}{backend}")
            assert status == "ok", f"%clorch start --nproc {n} failed"
            starts[n] = elapsed
            samples = time_cells(kernel, "%%distributed\npass", args.iters)
            p50, p90 = percentiles(samples)
            print(f"{f'%%distributed, {n} ranks':<28}{p50:>9.2f}{p90:>9.2f}{p50 / f50:>11.2f}{p90 / f90:>11.2f}")
            kernel.run("%clorch stop")
    finally:
        kernel.shutdown()
    print()
    from clorch_repl.topology import resolve_topology

    for n, elapsed in starts.items():
        backend = resolve_topology(n, backend=args.backend).backend
        ref = torchrun_start(n, backend)
        print(f"start {n} {backend} ranks: %clorch start {elapsed:.2f} s, torchrun (init + barrier + exit) "
              f"{ref:.2f} s, ratio {elapsed / ref:.2f}")


if __name__ == "__main__":
    main()
