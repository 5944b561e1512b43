"""What the stdin path costs a cell that asks nothing: an empty ``%%distributed`` cell sent as
JupyterLab sends it (``allow_stdin=True``: the relay finds the front end and the ranks may ask)
beside the same cell sent with ``allow_stdin=False`` (nbclient), interleaved in one session.

    python benchmarks/stdin_path.py [--iters 400]

Prints p50/p90 in milliseconds of each and the ratio (baseline: allow_stdin=False), with the
spread as the ratio of p90s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    nb = NotebookKernel()
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        start = nb.run("%clorch start --nproc 2 --backend gloo")
        assert start.status == "ok", start.text
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(args.iters):
            flag = bool(i % 2)
            t0 = time.perf_counter()
            reply = nb.collect(nb.send("%%distributed\npass\n", allow_stdin=flag), timeout=60)
            assert reply.status == "ok", reply.text
            if i >= 20:  # warm-up
                times[flag].append((reply.idle_at - t0) * 1e3)
        stats = {}
        for flag in (False, True):
            ordered = sorted(times[flag])
            stats[flag] = (statistics.median(ordered), ordered[int(len(ordered) * 0.9)])
        print(f"{'case':<34}{'p50 ms':>8}{'p90 ms':>8}")
        print(f"{'allow_stdin=False (baseline)':<34}{stats[False][0]:>8.2f}{stats[False][1]:>8.2f}")
        print(f"{'allow_stdin=True (JupyterLab)':<34}{stats[True][0]:>8.2f}{stats[True][1]:>8.2f}")
        print(f"ratio p50 {stats[True][0] / stats[False][0]:.2f}, p90 {stats[True][1] / stats[False][1]:.2f} "
              f"({len(times[True])} cells each)")
    finally:
        nb.shutdown()


if __name__ == "__main__":
    main()
