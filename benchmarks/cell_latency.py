"""Round trip of an empty ``%%distributed`` cell as a Jupyter client sees it, beside the floor.

    python benchmarks/cell_latency.py [--iters 200] [--nprocs 2,4] [--blocks 5]

The floor is the same round trip (execute_request until the kernel reports idle) of the same
notebook kernel running ``pass``, which no part of clorch_repl handles. The two are interleaved
cell by cell (in a random order within each pair), so that the load of a shared machine falls on
both alike: measured one after the other, a change of load between the two phases moved the
ratio by more than the changes being measured. In one kernel, not two, because two kernels'
history threads write one SQLite file and slowed each other's cells. Prints p50/p90
in milliseconds and the ratios, with their spread: the lowest and highest ratio of p50s over
``--blocks`` consecutive blocks of the pairs. Also times ``%clorch start`` until the group is
ready (cold: the session here runs with ``CLORCH_SPARES=0``), beside ``torchrun`` starting the
same group (``--starts`` times), and the start in a fresh notebook kernel whose ``%load_ext``
warmed spares (``CLORCH_SPARES=1``, once they are ready), and ``%clorch restart`` until the group
is usable again (the restart and the first cell after it, a barrier whose output shows that every
rank is a new process with an empty namespace), and the part of it that ended the old ranks,
in three situations, ``--restarts`` times each: a healthy group, after a rank's death
(``os._exit(3)`` on the last rank) and after a hang (rank 0 alone in a barrier, the cell ended
by its ``--timeout``). Restarts are timed in two sessions of
the same run, with warm spares (``--spares 1``, waiting before each restart until the spares are
ready, as they are when a user restarts seconds after the last one) and without (``--spares 0``,
the baseline), and the ratio of their medians is printed. Targets: p50 within 1.25x the floor at 2
ranks and 1.35x at 8 on a 16-core host, 1.4x at 2 on a 2-core one (issue 27; issue 12's were 1.5x at
2 and 1.8x at 4); start at most 0.4x torchrun's; restart at most 2 s on GPUs. With
``CLORCH_HEAD_START=0`` in this process's environment (the notebook kernel inherits it) the cells
take the path without the head start (clorch_repl.magics.head_start), for a comparison in one tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)
from rank_text import lines_of  # noqa: E402

CELL = "%%distributed\npass"


def round_trip(kernel: NotebookKernel, code: str) -> tuple[float, str]:
    """Seconds from execute_request to the idle status of that request, and the reply's status."""
    t0 = time.perf_counter()
    reply = kernel.collect(kernel.send(code), timeout=300)
    return reply.idle_at - t0, reply.status


def timed(kernel: NotebookKernel, code: str) -> float:
    elapsed, status = round_trip(kernel, code)
    assert status == "ok", f"{code!r} ended with status {status}"
    return elapsed


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p90 in milliseconds."""
    qs = statistics.quantiles(samples, n=10)
    return statistics.median(samples) * 1e3, qs[8] * 1e3


def interleaved(nb: NotebookKernel, iters: int) -> tuple[list[float], list[float]]:
    """``iters`` pairs of (floor, %%distributed) round trips, each pair in a random order."""
    for _ in range(max(5, iters // 10)):  # warm-up
        timed(nb, "pass")
        timed(nb, CELL)
    floor, cells = [], []
    for _ in range(iters):
        first_floor = random.random() < 0.5
        if first_floor:
            floor.append(timed(nb, "pass"))
        cells.append(timed(nb, CELL))
        if not first_floor:
            floor.append(timed(nb, "pass"))
    return floor, cells


def block_ratios(floor: list[float], cells: list[float], blocks: int) -> list[float]:
    """Ratio of p50s in each of ``blocks`` consecutive blocks of pairs (the spread of the ratio)."""
    size = max(1, len(floor) // blocks)
    return [statistics.median(cells[i:i + size]) / statistics.median(floor[i:i + size])
            for i in range(0, size * blocks, size) if cells[i:i + size]]


#: what precedes each timed restart: nothing, a rank's death, a hang ended by the cell's timeout
BEFORE_RESTART = {
    "healthy": None,
    "after a death": "%%distributed --ranks {last}\nimport os; os._exit(3)",
    "after a hang": "%%distributed --timeout 2\nimport torch.distributed as dist\nif rank == 0: dist.barrier()",
}
FRESH = ("%%distributed\nimport os, torch.distributed as dist\nassert 'clorch_marker' not in globals()\n"
         "clorch_marker = 1\ndist.barrier()\nprint(os.getpid())")


def wait_for_spares(nb: NotebookKernel, expected: bool, timeout_s: float = 120.0) -> None:
    """Until ``%clorch status`` says the warm spares (the session's, or before a start those the
    load warmed) are ready. ``expected``: spares were asked for, so a status that does not name
    them yet (the load's set is started after ``%load_ext`` returns) is waited out too; without,
    a status that names none returns at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = nb.run("%clorch status").text
        if ", ready," in text or ("warm spares" not in text and not expected):
            return
        time.sleep(0.2)
    raise AssertionError(f"the warm spares were not ready within {timeout_s:.0f} s")


def printed_pids(text: str, nproc: int) -> set[str]:
    """The pids the ranks printed (one line each) in :data:`FRESH`'s output."""
    return {line for r in range(nproc) for line in lines_of(text, r)}


#: In the notebook kernel: the seconds each part of a restart took: ending the old ranks
#: (Session.stop), the ranks started or the spares made ranks (the launcher's launch), the relay's
#: connect, the silent requests (the join), so that a restart's time splits into those and the rest
#: (the magic, the first cell). Wrappers of the real methods; what they do is unchanged.
TIME_PHASES = """
import collections as _collections, time as _time
from clorch_repl.launchers.local import LocalLauncher as _LocalLauncher
from clorch_repl.session.relay import Relay as _Relay
from clorch_repl.session.session import Session as _Session
_clorch_bench_phases = _collections.defaultdict(float)
def _clorch_bench_wrap(cls, name, label):
    if hasattr(cls, '_clorch_bench_' + name):
        return
    real = getattr(cls, name)
    setattr(cls, '_clorch_bench_' + name, real)
    def timed(self, *args, **kwargs):
        t0 = _time.monotonic()
        try:
            return real(self, *args, **kwargs)
        finally:
            _clorch_bench_phases[label] += _time.monotonic() - t0
    setattr(cls, name, timed)
for _cls, _name, _label in ((_Session, 'stop', 'stop'), (_LocalLauncher, 'launch', 'launch'),
                            (_Relay, 'connect', 'connect'), (_Relay, 'execute', 'join')):
    _clorch_bench_wrap(_cls, _name, _label)
"""
PHASES = ("stop", "launch", "connect", "join")


def phase_seconds(nb: NotebookKernel) -> dict[str, float]:
    """What :data:`TIME_PHASES` recorded since the last call, and resets it."""
    text = nb.run("import json as _json; print(_json.dumps(_clorch_bench_phases)); _clorch_bench_phases.clear()").text
    done = json.loads(text.strip().splitlines()[-1])
    return {phase: done.get(phase, 0.0) for phase in PHASES}


def restart_times(nb: NotebookKernel, nproc: int, repeats: int, spares: bool) -> dict[str, list[float]]:
    """Seconds from ``%clorch restart`` until a cell has run a barrier on every fresh rank, per
    situation in :data:`BEFORE_RESTART`, and (under ``NAME stop``) the part of each that ended the
    old ranks. Checks that the ranks are new processes with empty namespaces (the marker of the
    previous group is gone)."""
    times: dict[str, list[float]] = {name: [] for name in BEFORE_RESTART}
    times.update({f"{name} {phase}": [] for name in BEFORE_RESTART for phase in PHASES})
    assert nb.run(TIME_PHASES).status == "ok"
    assert nb.run(FRESH).status == "ok"
    for _ in range(repeats):
        for name, before in BEFORE_RESTART.items():
            wait_for_spares(nb, expected=spares)
            old = nb.run(FRESH.replace("assert 'clorch_marker' not in globals()\n", "")).text
            if before is not None:
                nb.run(before.format(last=nproc - 1), timeout=120)  # fails, as it should
            phase_seconds(nb)  # what the cells before did: nothing, normally
            t0 = time.perf_counter()
            _, status = round_trip(nb, "%clorch restart")
            assert status == "ok", f"%clorch restart {name} failed"
            fresh = nb.run(FRESH, timeout=120)
            elapsed = fresh.idle_at - t0
            assert fresh.status == "ok", fresh.text
            now = printed_pids(fresh.text, nproc)
            assert len(now) == nproc and not now & printed_pids(old, nproc), (old, fresh.text)
            times[name].append(elapsed)
            for phase, seconds in phase_seconds(nb).items():
                times[f"{name} {phase}"].append(seconds)
    return times


def warm_start(nproc: int, backend: str) -> float:
    """``%clorch start`` in a fresh notebook kernel whose ``%load_ext`` warmed spares
    (``CLORCH_SPARES=1``), once they are ready, as after a user's few seconds between the two."""
    nb = NotebookKernel(env={"CLORCH_SPARES": "1", "CLORCH_NPROC": str(nproc)})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        wait_for_spares(nb, expected=True)
        t0 = time.perf_counter()
        reply = nb.collect(nb.send(f"%clorch start{backend}"), timeout=300)
        assert reply.status == "ok" and "warm spare rank(s) taken" in reply.text, reply.text
        elapsed = reply.idle_at - t0
        nb.run("%clorch stop")
        return elapsed
    finally:
        nb.shutdown()


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
    parser.add_argument("--iters", type=int, default=200, help="pairs of cells per case")
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--blocks", type=int, default=5, help="blocks of pairs for the spread of the ratio")
    parser.add_argument("--backend", default=None, help="passed to %%clorch start (default: its own)")
    parser.add_argument("--restarts", type=int, default=3, help="timed restarts per situation (0: none)")
    parser.add_argument("--starts", type=int, default=3,
                        help="timed starts with spares warmed at %%load_ext, and torchrun starts, per rank count")
    args = parser.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]

    nb = NotebookKernel(env={"CLORCH_SPARES": "0"})  # cold starts here; spares only where asked for
    starts = {}
    restarts: dict[tuple[int, str], dict[str, list[float]]] = {}
    try:
        nb.run("%load_ext clorch_repl")
        print(f"{'case':<26}{'p50 ms':>8}{'p90 ms':>8}{'p50 ratio':>11}{'p90 ratio':>11}"
              f"   p50 ratio per block (min-max)")
        for n in nprocs:
            backend = f" --backend {args.backend}" if args.backend else ""
            elapsed, status = round_trip(nb, f"%clorch start --nproc {n}{backend}")
            assert status == "ok", f"%clorch start --nproc {n} failed"
            starts[n] = elapsed
            floor, cells = interleaved(nb, args.iters)
            f50, f90 = percentiles(floor)
            p50, p90 = percentiles(cells)
            spread = block_ratios(floor, cells, args.blocks)
            print(f"{'  floor (pass)':<26}{f50:>8.2f}{f90:>8.2f}{1:>11.2f}{1:>11.2f}")
            print(f"{f'  %%distributed, {n} ranks':<26}{p50:>8.2f}{p90:>8.2f}{p50 / f50:>11.2f}{p90 / f90:>11.2f}"
                  f"   {min(spread):.2f}-{max(spread):.2f}")
            nb.run("%clorch stop")
            for spares in ("1", "0") if args.restarts else ():
                assert nb.run(f"%clorch start --nproc {n}{backend} --spares {spares}").status == "ok"
                restarts[n, spares] = restart_times(nb, n, args.restarts, spares=spares == "1")
                nb.run("%clorch stop")
    finally:
        nb.shutdown()
    print()
    from clorch_repl.errors import ClorchError
    from clorch_repl.common.topology import resolve_topology

    for n, elapsed in starts.items():
        backend = resolve_topology(n, backend=args.backend).backend
        option = f" --backend {args.backend}" if args.backend else ""
        refs, warm = [], []
        # spares are warmed at load for the topology a plain start has: skip where this is another
        try:
            comparable = resolve_topology(n).backend == backend
        except ClorchError:  # more ranks than GPUs: a plain start would refuse, so nothing is warmed
            comparable = False
        for _ in range(max(1, args.starts)):
            refs.append(torchrun_start(n, backend))
            if args.starts and comparable:
                warm.append(warm_start(n, option))
        ref = statistics.median(refs)
        print(f"start {n} {backend} ranks: %clorch start {elapsed:.2f} s (cold), torchrun (init + barrier + exit) "
              f"median {ref:.2f} s [{min(refs):.2f}-{max(refs):.2f}], ratio {elapsed / ref:.2f}")
        if warm:
            print(f"start {n} {backend} ranks with spares warmed at %load_ext: median {statistics.median(warm):.2f} s "
                  f"[{min(warm):.2f}-{max(warm):.2f}] over {len(warm)}, ratio to torchrun {statistics.median(warm) / ref:.2f}")
    for (n, spares), cases in restarts.items():
        for name, samples in cases.items():
            if name not in BEFORE_RESTART:
                continue
            stops = cases[f"{name} stop"]
            line = (f"restart {n} ranks {name}, --spares {spares}: median {statistics.median(samples):.2f} s "
                    f"[{min(samples):.2f}-{max(samples):.2f}] over {len(samples)}, of which ending the old ranks "
                    f"{statistics.median(stops):.2f} s [{min(stops):.2f}-{max(stops):.2f}]")
            line += " (" + ", ".join(f"{phase} {statistics.median(cases[f'{name} {phase}']):.3f}"
                                     for phase in PHASES[1:]) + ")"
            cold = restarts.get((n, "0"), {}).get(name)
            if spares == "1" and cold:
                line += f"; ratio to --spares 0: {statistics.median(samples) / statistics.median(cold):.2f}"
            print(line)


if __name__ == "__main__":
    main()
