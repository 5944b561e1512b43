"""Does the ranks' CPU priority change an empty ``%%distributed`` cell at scale? (issue 39: an empty
cell at 64 ranks within 2x a plain kernel's ``pass``.)

    python benchmarks/rank_priority.py [--nprocs 64] [--rounds 4] [--iters 60]

Why: on 16 cores 64 ranks' threads wake at once for every cell, and the notebook kernel's main
thread, which reads every rank's reply one after another, competes with them for a core. A rank
at a lower priority (``nice``), or under ``SCHED_BATCH`` (it never preempts on waking), would
leave the notebook's thread its core; so would ranks kept off the first two cores ("cores 2+",
which a rank's NUMA binding could do). One session of N gloo ranks started by a notebook kernel
(``CLORCH_SPARES=0``); each round runs the modes in a random order, each mode setting every
thread of every rank from inside a cell, then ``--iters`` pairs of (``pass``, empty cell) in
random order (``cell_latency.interleaved``). Printed per mode: the cell / ``pass`` ratio of p50s,
median [min-max] over the rounds, the cell's p50, and the ratio to the normal priority's of the
same round (the baseline of the same run). Changing a thread's policy back needs CAP_SYS_NICE
(root): run it as root, or the cell setting a mode says which change was refused.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

from cell_latency import interleaved  # noqa: E402
from notebook_kernel import NotebookKernel  # noqa: E402

#: each mode: the scheduling policy and the nice value every rank thread gets
#: each mode: the scheduling policy, the nice value and the first core every rank thread gets (the
#: cores before it left to the notebook kernel and its client)
MODES = {"normal": ("SCHED_OTHER", 0, 0), "nice 5": ("SCHED_OTHER", 5, 0), "SCHED_BATCH": ("SCHED_BATCH", 0, 0),
         "SCHED_BATCH, nice 5": ("SCHED_BATCH", 5, 0), "cores 2+": ("SCHED_OTHER", 0, 2)}
SET = ("%%distributed\nimport os as _o\nfor _t in _o.listdir('/proc/self/task'):\n    try:\n"
       "        _o.sched_setscheduler(int(_t), _o.{policy}, _o.sched_param(0))\n"
       "        _o.setpriority(_o.PRIO_PROCESS, int(_t), {nice})\n"
       "        _o.sched_setaffinity(int(_t), range({first}, _o.cpu_count()))\n"
       "    except OSError as _e:\n        print('refused:', _e)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=60, help="pairs of (pass, empty cell) per mode and round")
    args = parser.parse_args()
    nb = NotebookKernel(env={"CLORCH_SPARES": "0"})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        started = nb.run(f"%clorch start --nproc {args.nprocs} --backend gloo", timeout=600)
        assert started.status == "ok", started.text
        ratios: dict[str, list[float]] = {m: [] for m in MODES}
        cells: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in random.sample(list(MODES), len(MODES)):
                policy, nice, first = MODES[mode]
                set_mode = nb.run(SET.format(policy=policy, nice=nice, first=first))
                if set_mode.status != "ok" or "refused" in set_mode.text:
                    sys.exit(f"{mode}: the ranks could not take it:\n{set_mode.text}")
                floor, cell = interleaved(nb, args.iters)
                ratios[mode].append(statistics.median(cell) / statistics.median(floor))
                cells[mode].append(statistics.median(cell) * 1e3)
        for mode in MODES:
            against = [a / b for a, b in zip(ratios[mode], ratios["normal"])]
            print(f"{args.nprocs} ranks, {mode:>19}: empty cell / pass {statistics.median(ratios[mode]):.2f}x "
                  f"[{min(ratios[mode]):.2f}-{max(ratios[mode]):.2f}], cell p50 {statistics.median(cells[mode]):.2f} ms; "
                  f"/ normal's {statistics.median(against):.3f} [{min(against):.3f}-{max(against):.3f}] "
                  f"over {args.rounds} rounds", flush=True)
        nb.run("%clorch stop")
    finally:
        nb.shutdown()


if __name__ == "__main__":
    main()
