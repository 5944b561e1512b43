"""The notebook side's CPU per rank per empty cell (issue 39): what the relay costs, serially.

    python benchmarks/relay_cost.py [--nprocs 16,32] [--cells 200] [--blocks 5] [--profile 30] [--ab-compact 12]

Starts a session of N gloo ranks in this process through the engine (no IPython, no notebook
kernel: the relay is driven as the magic drives it), warms it up, then runs ``--blocks`` blocks
of ``--cells`` empty cells and prints, per block, the main thread's CPU time (``time.thread_time``:
the relay's own work, not ZeroMQ's I/O thread nor the ranks) per rank per cell, the wall
time per cell, and a rank's own CPU per cell (its kernel process, all threads: what the ranks
together need of the host's cores each cell); then, per thread of a rank, its CPU and context
switches a cell over all blocks; then the median and [min-max] over the blocks. The ranks' own work runs in
parallel on a many-core host, while the notebook's is serial in the ranks: the first figure is
what an empty cell at scale is made of. On a 2-core box the wall figure is the ranks' load, not
the relay's; compare the CPU figure.

For an A/B comparison run it from the root of each tree (the ranks import clorch_repl from the
working directory, which this script also puts first on its path) and alternate the runs.
``--profile N``: cProfile of the main thread over one more block, top N by internal time;
``--rank-profile N`` the same of rank 0's main thread (where a rank's part of an empty cell goes).
``--timeline``: one more block, timed inside the cell (the notebook's clock): when the first and
the last request were sent, when the first and the last reply were read, and the cell's end, each
from the cell's start, median [p90] over the block; it says whether a cell's wall is the sends,
the ranks or the reading of the replies. ``--ab-compact PAIRS`` measures instead, in one session
per rank count, the ranks' compact reply (issue 39) against the lean reply's Jupyter form
(``CLORCH_COMPACT_REPLIES=0``, read by the relay per cell), PAIRS pairs of blocks in alternating
order, and prints each figure's ratio, median [min-max] over the pairs. ``--io-threads K``: the
notebook's ZeroMQ context gets K I/O threads (``channels.IO_THREADS``; 1 is what clorch_repl uses).
``--pin``: the notebook's threads on the first core, each rank's threads on one of the others, in
turn (an experiment).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.getcwd())  # the tree being measured, for this process and (cwd) for the ranks

from clorch_repl.common import env_vars  # noqa: E402
from clorch_repl.wire import framing  # noqa: E402
from clorch_repl.session.engine import CellHooks, local_session  # noqa: E402

CELL = "pass"


class Quiet(CellHooks):
    """Hooks that keep nothing (an empty cell shows nothing anyway)."""


def kernel_share() -> tuple[int, int]:
    """This thread's (user, system) CPU in clock ticks (/proc): how much of it went in system calls."""
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def block(session, cells: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """(main-thread CPU seconds, wall seconds, the system calls' share of that CPU) of ``cells``
    empty cells, every one checked ok."""
    hooks = Quiet()
    (user0, sys0), cpu0, wall0 = kernel_share(), time.thread_time(), time.perf_counter()
    for _ in range(cells):
        outcome = session.run(CELL, None, None, hooks)
        if not outcome.ok:
            raise SystemExit(f"an empty cell failed: {outcome}")
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    user1, sys1 = kernel_share()
    return cpu, wall, (sys1 - sys0) / max(1, user1 - user0 + sys1 - sys0)


def ranks_cpu(pids: list[int]) -> float:
    """The CPU seconds the ranks' kernel processes used so far, all their threads (/proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def threads_use(pids: list[int]) -> dict[str, list[int]]:
    """Per thread name, summed over the ranks' kernel processes: [CPU ticks, voluntary and
    involuntary context switches] so far (/proc; the main thread is named "main"). Which
    threads a cell wakes, and how often, is what 4 ranks a core multiply."""
    use: dict[str, list[int]] = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    head, tail = fh.read().rsplit(")", 1)
                with open(f"/proc/{pid}/task/{tid}/status") as fh:
                    status = dict(line.split(":", 1) for line in fh if ":" in line)
            except OSError:  # a thread that ended meanwhile
                continue
            name = "main" if tid == str(pid) else head.split("(", 1)[1]
            fields = tail.split()
            row = use.setdefault(name, [0, 0, 0])
            row[0] += int(fields[11]) + int(fields[12])
            row[1] += int(status["voluntary_ctxt_switches"])
            row[2] += int(status["nonvoluntary_ctxt_switches"])
    return use


def print_threads(before: dict[str, list[int]], after: dict[str, list[int]], cells: int, n: int) -> None:
    """What :func:`threads_use` grew by, a rank a cell, busiest thread first."""
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    rows = []
    for name, (ticks, vol, invol) in after.items():
        t0, v0, i0 = before.get(name, [0, 0, 0])
        rows.append(((ticks - t0) * tick_us / cells / n, (vol - v0) / cells / n, (invol - i0) / cells / n, name))
    print(f"n={n}: a rank's threads a cell (CPU us, voluntary / involuntary context switches):", flush=True)
    for cpu, vol, invol, name in sorted(rows, reverse=True):
        if cpu or vol >= 0.01:
            print(f"  {name:>18}: {cpu:7.1f} us  {vol:5.2f} / {invol:5.2f}", flush=True)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} [{min(values):.2f}-{max(values):.2f}]"


def timeline(session, cells: int) -> None:  # type: ignore[no-untyped-def]
    """Print when, from each cell's start, its last request went, its first and last reply came,
    and it ended (see the module's docstring)."""
    channels = session.relay.channels
    send, read = channels.send, channels.read
    marks: dict[str, list[float]] = {}

    def timed_send(*args, **kwargs):  # type: ignore[no-untyped-def]
        msg_id = send(*args, **kwargs)
        marks["sent"].append(time.perf_counter())
        return msg_id

    def timed_read(timeout_s):  # type: ignore[no-untyped-def]
        for rank, kind, msg in read(timeout_s):
            if kind == "shell":
                marks["reply"].append(time.perf_counter())
            yield rank, kind, msg

    channels.send, channels.read = timed_send, timed_read
    rows: dict[str, list[float]] = {"first request sent": [], "last request sent": [], "first reply read": [], "last reply read": [],
                                    "cell over": []}
    hooks = Quiet()
    try:
        for _ in range(cells):
            marks.update(sent=[], reply=[])
            t0 = time.perf_counter()
            if not session.run(CELL, None, None, hooks).ok:
                raise SystemExit("an empty cell failed")
            end = time.perf_counter()
            rows["first request sent"].append(marks["sent"][0] - t0)
            rows["last request sent"].append(marks["sent"][-1] - t0)
            rows["first reply read"].append(marks["reply"][0] - t0)
            rows["last reply read"].append(marks["reply"][-1] - t0)
            rows["cell over"].append(end - t0)
    finally:
        del channels.send, channels.read
    for name, values in rows.items():
        values.sort()
        print(f"  {name:>18}: {statistics.median(values) * 1e3:6.2f} ms [p90 {values[int(len(values) * 0.9)] * 1e3:.2f}]")


def pin(pids: list[int]) -> None:
    """``--pin``: this process's threads on core 0, each rank's on one of the others in turn (an
    experiment: whether migrations and a rank's threads on different cores inflate its CPU)."""
    cores = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cores[0]})
    for i, pid in enumerate(pids):
        core = cores[1 + i % (len(cores) - 1)]
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except OSError:  # a thread that ended meanwhile
                pass


def measure(n: int, cells: int, blocks: int, profile: int, show_timeline: bool, pinned: bool = False,
            rank_profile: int = 0) -> None:
    session = local_session(n, "gloo")
    session.start()
    try:
        where = session.run("import clorch_repl; print(clorch_repl.__file__)", [0], None, Quiet())
        assert where.ok
        if pinned:
            pin([pid for pid in session.pids() if pid])
        block(session, max(20, cells // 5))  # warm-up
        cpu_us, wall_ms, rank_us = [], [], []
        pids = [pid for pid in session.pids() if pid]
        threads0 = threads_use(pids)
        for i in range(blocks):
            ranks0 = ranks_cpu(pids)
            cpu, wall, system = block(session, cells)
            rank_us.append((ranks_cpu(pids) - ranks0) / cells / len(pids) * 1e6)
            cpu_us.append(cpu / cells / n * 1e6)
            wall_ms.append(wall / cells * 1e3)
            print(f"  n={n} block {i}: notebook CPU {cpu_us[-1]:6.2f} us/rank/cell ({system:.0%} in system calls),"
                  f" wall {wall_ms[-1]:6.2f} ms/cell, a rank's CPU {rank_us[-1]:5.0f} us/cell,"
                  f" load {os.getloadavg()[0]:.1f}", flush=True)
        print(f"n={n}: notebook CPU us/rank/cell {spread(cpu_us)}   wall ms/cell {spread(wall_ms)}"
              f"   ({blocks} blocks of {cells} cells, tree {os.getcwd()})", flush=True)
        print(f"n={n}: a rank's own CPU a cell (its kernel process, every thread) {spread(rank_us)} us;"
              f" all {n} ranks' together {statistics.median(rank_us) * n / 1e3:.2f} ms of CPU a cell", flush=True)
        print_threads(threads0, threads_use(pids), cells * blocks, n)
        if show_timeline:
            print(f"n={n}: inside a cell, from its start ({cells} cells):", flush=True)
            timeline(session, cells)
        if profile:
            prof = cProfile.Profile(time.thread_time)  # CPU, not wall: a blocking poll costs nothing
            prof.enable()
            block(session, cells)
            prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(profile)
        if rank_profile:
            print(f"n={n}: rank 0's main thread over {cells} more cells (cProfile, CPU time):", flush=True)
            print(profile_rank(session, cells, rank_profile), flush=True)
    finally:
        session.stop()


def profile_rank(session, cells: int, lines: int) -> str:  # type: ignore[no-untyped-def]
    """cProfile of rank 0's main thread (CPU time) over ``cells`` empty cells on every rank: where
    a rank's part of an empty cell goes (its kernel, IPython, clorch_repl's lean path). Enabled by
    a cell and read by another, so the two cells' own ends and starts are in it too."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.prof.txt")
        on = session.run("import cProfile as _cp, time as _t\n_clorch_prof = _cp.Profile(_t.thread_time)\n"
                         "_clorch_prof.enable()", [0], None, Quiet())
        assert on.ok, on
        block(session, cells)
        off = session.run(f"_clorch_prof.disable()\nimport io as _io, pstats as _ps\n_b = _io.StringIO()\n"
                          f"_ps.Stats(_clorch_prof, stream=_b).sort_stats('tottime').print_stats({lines})\n"
                          f"open({out!r}, 'w').write(_b.getvalue())\ndel _clorch_prof, _b", [0], None, Quiet())
        assert off.ok, off
        with open(out) as fh:
            return fh.read()


def ab_compact(n: int, cells: int, pairs: int) -> None:
    """The ranks' compact reply against the Jupyter form of the lean reply (``CLORCH_COMPACT_REPLIES``,
    read by the relay per cell), in one session: ``pairs`` pairs of blocks, the order alternated
    pair by pair; each pair's ratio (compact / Jupyter form) of the notebook's CPU a rank a cell,
    the wall a cell and a rank's CPU a cell, median [min-max] over the pairs."""
    session = local_session(n, "gloo")
    session.start()
    name = env_vars.COMPACT_REPLIES.name
    before = os.environ.get(name)
    compact = [0]  # replies read in the compact form: each block checks it got the form it asked for
    read = framing.MessageDecoder._compact

    def counted(decoder, frame):  # type: ignore[no-untyped-def]
        compact[0] += 1
        return read(decoder, frame)

    framing.MessageDecoder._compact = counted  # type: ignore[method-assign]
    try:
        print(f"n={n}: clorch_repl from {os.path.dirname(os.path.dirname(framing.__file__))}", flush=True)
        pids = [pid for pid in session.pids() if pid]
        block(session, max(20, cells // 5))  # warm-up
        figures: dict[str, list[tuple[float, float, float]]] = {"1": [], "0": []}
        for i in range(pairs):
            for value in (("1", "0") if i % 2 == 0 else ("0", "1")):
                os.environ[name] = value
                ranks0, compact0 = ranks_cpu(pids), compact[0]
                cpu, wall, _ = block(session, cells)
                figures[value].append((cpu / cells / n * 1e6, wall / cells * 1e3,
                                       (ranks_cpu(pids) - ranks0) / cells / len(pids) * 1e6))
                if compact[0] - compact0 != (cells * n if value == "1" else 0):
                    raise SystemExit(f"{name}={value}: {compact[0] - compact0} compact replies in {cells} cells "
                                     f"of {n} ranks: this tree's relay or ranks do not answer as asked")
        for value, label in (("0", "Jupyter form"), ("1", "compact")):
            rows = figures[value]
            print(f"n={n} {label:>12}: notebook CPU {statistics.median(r[0] for r in rows):6.2f} us/rank/cell, "
                  f"wall {statistics.median(r[1] for r in rows):6.2f} ms/cell, "
                  f"a rank's CPU {statistics.median(r[2] for r in rows):5.0f} us/cell", flush=True)
        for i, what in enumerate(("notebook CPU a rank a cell", "wall a cell", "a rank's CPU a cell")):
            ratios = [new[i] / old[i] for new, old in zip(figures["1"], figures["0"])]
            print(f"n={n} compact / Jupyter form, {what}: {statistics.median(ratios):.3f} "
                  f"[{min(ratios):.3f}-{max(ratios):.3f}] ({pairs} pairs of {cells} cells)", flush=True)
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        framing.MessageDecoder._compact = read  # type: ignore[method-assign]
        session.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="16,32")
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, help="cProfile top N over one more block")
    parser.add_argument("--timeline", action="store_true", help="one more block, timed inside each cell")
    parser.add_argument("--rank-profile", type=int, default=0, metavar="N",
                        help="cProfile of rank 0's main thread over one more block, top N by internal time")
    parser.add_argument("--io-threads", type=int, default=0, help="the notebook's ZeroMQ I/O threads")
    parser.add_argument("--pin", action="store_true", help="the notebook on core 0, each rank on one other core")
    parser.add_argument("--ab-compact", type=int, default=0, metavar="PAIRS",
                        help="instead: PAIRS pairs of blocks, the ranks' compact reply against the Jupyter form")
    args = parser.parse_args()
    if args.ab_compact and (args.profile or args.timeline or args.pin or args.io_threads):
        parser.error("--ab-compact measures alone: leave out --profile, --timeline, --pin and --io-threads")
    if args.io_threads:
        from clorch_repl.session import channels
        channels.IO_THREADS = args.io_threads
        print(f"the notebook's ZeroMQ context: {args.io_threads} I/O threads", flush=True)
    for n in (int(x) for x in args.nprocs.split(",")):
        if args.ab_compact:
            ab_compact(n, args.cells, args.ab_compact)
        else:
            measure(n, args.cells, args.blocks, args.profile, args.timeline, args.pin, args.rank_profile)


if __name__ == "__main__":
    main()
