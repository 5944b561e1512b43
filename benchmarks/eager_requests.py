"""A rank's shell requests started eagerly against on the loop's next turn (issue 39; Python 3.12+).

    python benchmarks/eager_requests.py [--nprocs 64] [--cells 200] [--pairs 8]

Why: at 64 gloo ranks on a 16-core host an empty cell is bounded by the ranks' CPU, and a third
of a rank's is the event loop around the request (``rank_layers.py``). On Python 3.12 and later a
rank starts each request's task eagerly (``clorch_repl.kernel.shell_recv``): the cell runs inside
the callback that read it, without the task's scheduling, its loop turn and its done callback.

One session of N gloo ranks through the engine (``relay_cost.py``'s). Blocks of ``--cells`` empty
cells alternate, in random order per pair, between the two starts, switched on every rank by a
cell that applies ``one_task_per_request`` again (a warm-up block after each switch is not
counted). Per block: the ranks' CPU per rank per cell (every thread of every rank's kernel
process, ``/proc/<pid>/task/*/schedstat``, nanoseconds) and the wall time per cell. Prints each
start's medians and the ratio eager / lazy per pair, median [min-max]. On Python 3.11 it says that
the ranks have no eager tasks and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.getcwd())  # the tree being measured (see relay_cost.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from relay_cost import Quiet, block  # noqa: E402

from clorch_repl.kernel.shell_recv import EAGER_TASKS  # noqa: E402
from clorch_repl.session.engine import local_session  # noqa: E402

SWITCH = ("from clorch_repl.kernel.shell_recv import one_task_per_request as _one\n"
          "assert _one(get_ipython().kernel, eager={eager})\ndel _one")
STARTS = {"lazy": False, "eager": True}


def ranks_cpu_ns(pids: list[int]) -> int:
    """Nanoseconds on a CPU so far, every thread of the given processes (schedstat's first field)."""
    total = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            except OSError:  # a thread that ended meanwhile
                continue
    return total


def measure(n: int, cells: int, pairs: int) -> None:
    session = local_session(n, "gloo")
    session.start()
    try:
        pids = [pid for pid in session.pids() if pid]
        block(session, max(50, cells // 2))  # warm-up
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in STARTS}
        for _ in range(pairs):
            for name in random.sample(list(STARTS), len(STARTS)):
                outcome = session.run(SWITCH.format(eager=STARTS[name]), None, None, Quiet())
                if not outcome.ok:
                    raise SystemExit(f"switching the ranks to {name} starts failed: {outcome}")
                block(session, max(20, cells // 5))
                cpu0 = ranks_cpu_ns(pids)
                _, wall, _ = block(session, cells)
                cpu = ranks_cpu_ns(pids) - cpu0
                figures[name].append((cpu / len(pids) / cells / 1e3, wall / cells * 1e3))
    finally:
        session.stop()
    print(f"n={n}, {pairs} pairs of {cells} empty cells:")
    for name, rows in figures.items():
        print(f"  {name:>5}: a rank's CPU {statistics.median(r[0] for r in rows):6.1f} us a cell, "
              f"wall {statistics.median(r[1] for r in rows):6.3f} ms a cell")
    for what, i in (("a rank's CPU", 0), ("wall", 1)):
        ratios = [e[i] / lz[i] for e, lz in zip(figures["eager"], figures["lazy"])]
        print(f"  eager / lazy, {what}: {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="64")
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=8)
    args = parser.parse_args()
    if EAGER_TASKS is None:
        print(f"Python {sys.version.split()[0]} has no eager tasks (3.12 and later): nothing to compare")
        return
    for n in (int(x) for x in args.nprocs.split(",")):
        measure(n, args.cells, args.pairs)


if __name__ == "__main__":
    main()
