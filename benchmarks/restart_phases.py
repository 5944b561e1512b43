"""Where a healthy ``%clorch restart``'s time goes (issue 39: "within 1 s in every situation").

    python benchmarks/restart_phases.py [--nproc 1] [--rounds 5] [--backend nccl]

Two parts, each alternated over ``--rounds``:

1. **The restart's phases**, in this process through the engine (no notebook kernel; warm spares
   on, ``CLORCH_SPARES=1``), as the magic drives it: the stop (``Session.stop``: the old ranks
   asked to shut down and waited for), the spares made ranks (``Launcher.launch``), the relay's
   connect, the join (the ranks' ``set_device`` and ``init_process_group``, with NCCL's eager
   communicator), and the first cell's barrier. Each restart either follows the previous cell at
   once (``at once``, what a user's restart is) or after the old ranks were stopped and the GPU
   left idle for ``--idle`` seconds (``idle first``: the stop is then not part of the restart).
   The phases are read by wrapping those methods here; what they do is unchanged.
2. **The GPU right after a process left it**: a plain Python process (no clorch) that created a
   CUDA context, an NCCL communicator and a 1 GiB tensor exits; a second one, torch already
   imported before the first's exit, times ``set_device``, ``init_process_group(device_id=...)``
   and a barrier, either at once after the exit or after ``--idle`` seconds. If the second is
   slower at once, the driver is still tearing the first down after its exit, and no order of
   the notebook's steps can hide it.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

sys.path.insert(0, os.getcwd())  # the tree being measured, for this process and (cwd) for the ranks

PHASES: dict[str, list[float]] = collections.defaultdict(list)


def _wrap(cls: Any, name: str, label: str) -> None:
    """``cls.name`` timed into PHASES[label] (wall seconds of each call)."""
    real = getattr(cls, name)

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            PHASES[label].append(time.perf_counter() - t0)

    setattr(cls, name, timed)


T0 = [0.0]


def _stamp(record: Any) -> bool:
    record.relative = f"+{time.perf_counter() - T0[0]:.3f} s"
    return True


def restart_phases(nproc: int, backend: str, rounds: int, idle_s: float) -> dict[str, dict[str, list[float]]]:
    os.environ["CLORCH_SPARES"] = "1"
    from clorch_repl.launchers.local import LocalLauncher
    from clorch_repl.session.engine import CellHooks, local_session
    from clorch_repl.session.relay import Relay
    from clorch_repl.session.session import Session

    import logging
    # when each rank's shell and iopub first answered the connect (session.channels' debug lines),
    # stamped from the restart's start
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("    %(relative)s %(message)s"))
    handler.addFilter(_stamp)
    channels_log = logging.getLogger("clorch_repl.session.channels")
    channels_log.addHandler(handler)
    channels_log.setLevel(logging.DEBUG)
    from clorch_repl.common import procs
    from clorch_repl.placement import teardown

    _wrap(Session, "stop", "stop")
    for module, name, label in ((procs, "wait_gone", "stop: waiting for exits"),
                                (teardown, "end_supervised", "stop: the supervisors ended")):
        real = getattr(module, name)

        def timed(*args: Any, _real: Any = real, _label: str = label, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                PHASES[_label].append(time.perf_counter() - t)
                print(f"    +{time.perf_counter() - T0[0]:.3f} s {_label} ({time.perf_counter() - t:.3f} s)", flush=True)

        setattr(module, name, timed)
    _wrap(LocalLauncher, "launch", "spares made ranks")
    _wrap(Relay, "connect", "connect")
    _wrap(Relay, "execute", "join")  # the start's only execute is the join (silent cells go through it)
    hooks = CellHooks()
    barrier = "import torch.distributed as dist; dist.barrier()"
    session = local_session(nproc, backend)
    session.start()
    out: dict[str, dict[str, list[float]]] = {case: collections.defaultdict(list) for case in
                                              ("at once", "idle first", "at once, the spares answered first")}

    def spares_ready(answered: bool) -> None:
        """Until the spares serve (their kernels' event loops run: what %clorch status calls ready);
        ``answered``: and then until each answers a kernel_info on its shell, timed from the moment
        it was seen serving."""
        deadline = time.monotonic() + 120
        while not all(ready for _, _, ready in session.group.spare_usage()) or not session.group.spare_usage():
            if time.monotonic() > deadline:
                raise SystemExit("the warm spares were not ready within 120 s")
            time.sleep(0.01)
        if answered:
            t = time.perf_counter()
            for spare in session.group.spares:
                client = spare.client()
                client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
                try:
                    client.kernel_info(reply=True, timeout=30)
                finally:
                    client.stop_channels()
            print(f"    the spares answered {time.perf_counter() - t:.3f} s after they were seen serving", flush=True)

    try:
        assert session.run(barrier, None, None, hooks).ok
        for r in range(rounds):
            cases = ("at once", "idle first", "at once, the spares answered first")
            for case in (cases if r % 2 == 0 else cases[::-1]):
                spares_ready(answered=case.endswith("first") and case != "idle first")
                assert session.run("x = 1", None, None, hooks).ok
                PHASES.clear()
                t0 = T0[0] = time.perf_counter()
                if case == "idle first":
                    session.stop(keep_logs=True)
                    time.sleep(idle_s)
                    PHASES.clear()
                    t0 = T0[0] = time.perf_counter()
                    session.start()
                else:
                    session.restart()
                t1 = time.perf_counter()
                assert session.run(barrier, None, None, hooks).ok
                t2 = time.perf_counter()
                row = out[case]
                for label, values in PHASES.items():
                    row[label].append(sum(values))
                row["first barrier"].append(t2 - t1)
                row["restart + first barrier"].append(t2 - t0)
                print(f"round {r + 1} {case}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in row.items()), flush=True)
    finally:
        session.stop()
    return out


FIRST = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 28, device="cuda")  # 1 GiB
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    os._exit(0)
""")
SECOND = textwrap.dedent("""
    import json, os, sys, time, torch, torch.distributed as dist
    print("imported", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    torch.cuda.set_device(0)
    torch.cuda.init(); torch.empty(1, device="cuda")
    t1 = time.perf_counter()
    dist.init_process_group("nccl", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    t2 = time.perf_counter()
    dist.barrier(); torch.cuda.synchronize()
    t3 = time.perf_counter()
    print(json.dumps({"context": t1 - t0, "init_process_group": t2 - t1, "barrier": t3 - t2}), flush=True)
    os._exit(0)
""")


def gpu_after_exit(rounds: int, idle_s: float) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {"at once": collections.defaultdict(list),
                                              "idle first": collections.defaultdict(list)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for case in (("at once", "idle first") if r % 2 == 0 else ("idle first", "at once")):
                first = subprocess.Popen([sys.executable, "-c", FIRST, os.path.join(tmp, f"a{r}{case}")],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                second = subprocess.Popen([sys.executable, "-c", SECOND, os.path.join(tmp, f"b{r}{case}")],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert first.stdout.readline().strip() == "ready"
                assert second.stdout.readline().strip() == "imported"
                t0 = time.perf_counter()
                first.stdin.write("\n")
                first.stdin.flush()
                first.wait()
                exit_s = time.perf_counter() - t0
                if case == "idle first":
                    time.sleep(idle_s)
                second.stdin.write("\n")
                second.stdin.flush()
                import json
                times = json.loads(second.stdout.readline())
                second.wait()
                times["the first's exit"] = exit_s
                for k, v in times.items():
                    out[case][k].append(v)
                print(f"round {r + 1} {case}: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
    return out


def show(title: str, table: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n{title} (median [min-max] s)")
    for case, row in table.items():
        print(f"  {case}:")
        for label, values in row.items():
            print(f"    {label:<28} {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default=None, help="nccl on GPUs (default), gloo without")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds the GPU is left idle in the 'idle first' case")
    parser.add_argument("--skip-plain", action="store_true", help="skip part 2 (it needs a GPU)")
    args = parser.parse_args()
    import torch
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    show("restart phases", restart_phases(args.nproc, backend, args.rounds, args.idle))
    if backend == "nccl" and not args.skip_plain:
        show("a plain process setting up the GPU after another left it", gpu_after_exit(args.rounds, args.idle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
