"""Values between notebook and ranks, and how far apart ranks' identical lines arrive.

    python benchmarks/transfer.py [--nproc 2] [--mb 10,100] [--repeats 3]

1. ``%clorch pull`` and ``%clorch push`` of a float32 tensor of each size per rank, beside the
   floor measured in the same run: ``torch.save`` of the same tensor to a file and
   ``torch.load(weights_only=True)`` of it, once per rank, in this process (what a transfer
   cannot avoid). Prints median seconds over the repeats, the spread (min-max) and the ratio.
2. The arrival skew of identical lines: every rank prints the same 250 lines (some while
   computing); for each line, the time between the first and the last rank's copy reaching the
   notebook. This is what the merge hold (``display.MERGE_HOLD_S``) has to cover.

Runs in this process with IPython's real shell and real ranks (no notebook kernel needed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from clorch_repl.session.sink import PlainSink  # noqa: E402


class _Arrivals(PlainSink):
    """An output sink that records when each rank's copy of each line arrived."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[int, float]] = {}

    def output(self, item: Any) -> None:
        if item.kind == "stream":
            now = time.monotonic()
            for line in item.content["text"].splitlines():
                self.seen.setdefault(line, {})[item.rank] = now


def spread(samples: list[float]) -> str:
    return f"{statistics.median(samples):.3f} s ({min(samples):.3f}-{max(samples):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mb", default="10,100")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from clorch_repl.magics import magics_for
    from clorch_repl.notebook.display import MERGE_HOLD_S

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "clorch_repl")
    ip.run_line_magic("clorch", f"start --nproc {args.nproc}")
    session = magics_for(ip).session
    try:
        print(f"{'per rank':>9}  {'floor: save+load x ranks':>26}  {'pull':>24}  {'ratio':>6}  "
              f"{'push':>24}  {'ratio':>6}")
        for mb in (float(x) for x in args.mb.split(",")):
            n = int(mb * 1_000_000 // 4)
            limit = f"--max-mb {mb * 1.1 + 1:g}"
            ip.run_cell(f"%%distributed\nimport torch\nbig = torch.randn({n})")
            value = torch.randn(n)
            floor, pulls, pushes = [], [], []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    t0 = time.perf_counter()
                    for rank in range(args.nproc):
                        path = os.path.join(tmp, f"{rank}.pt")
                        torch.save(value, path)
                        torch.load(path, weights_only=True)
                    floor.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ip.run_line_magic("clorch", f"pull big {limit}")
                pulls.append(time.perf_counter() - t0)
                assert ip.user_ns["big"][args.nproc - 1].numel() == n
                ip.user_ns["sent"] = value
                t0 = time.perf_counter()
                ip.run_line_magic("clorch", f"push sent {limit}")
                pushes.append(time.perf_counter() - t0)
            base = statistics.median(floor)
            print(f"{mb:>6g} MB  {spread(floor):>26}  {spread(pulls):>24}  {statistics.median(pulls) / base:>6.2f}  "
                  f"{spread(pushes):>24}  {statistics.median(pushes) / base:>6.2f}")
            ip.user_ns.pop("big", None)
            ip.user_ns.pop("sent", None)

        arrivals = _Arrivals()
        code = ("import time, torch\n"
                "for i in range(200):\n    print(f'line {i}', flush=True); time.sleep(0.005)\n"
                "for i in range(50):\n    x = torch.randn(200, 200) @ torch.randn(200, 200)\n"
                "    print(f'step {i}', flush=True)")
        session.run(code, None, None, arrivals)
        skews = sorted((max(t.values()) - min(t.values())) * 1e3
                       for t in arrivals.seen.values() if len(t) == args.nproc)
        q = statistics.quantiles(skews, n=100)
        print(f"\nidentical lines from {args.nproc} ranks, {len(skews)} lines: the last copy arrived "
              f"p50 {statistics.median(skews):.1f} ms, p99 {q[98]:.1f} ms, max {skews[-1]:.1f} ms after the first; "
              f"merge hold {MERGE_HOLD_S * 1e3:.0f} ms")
    finally:
        ip.run_line_magic("clorch", "stop")


if __name__ == "__main__":
    main()
