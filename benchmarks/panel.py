"""What ``%clorch top`` costs the ranks: an empty ``%%distributed`` cell and a training loop with
the panel open and closed, in one notebook kernel, interleaved.

    python benchmarks/panel.py [--nproc 2] [--rounds 6] [--cells 100] [--steps 300] [--interval 1.0]

Each round runs, with the panel closed and then open (who goes first alternates by round):
``--cells`` empty cells (the round trip a Jupyter client sees, median) and one cell that trains
the example's tiny MLP for ``--steps`` optimizer steps (steps per second, timed inside the ranks).
The panel asks every rank once per ``--interval`` seconds, from the notebook kernel's main
thread. Prints, per figure, the median over the rounds with its spread and the ratio open/closed
(the median of the rounds' own ratios, with their spread). Targets (issue 25): nothing measurable
closed (there is no panel then), under 1 % open.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)

TRAIN = """%%distributed
import time
from clorch_repl.examples.distributed_training import train
r = train(rank, world_size, device, {{"epochs": 100, "stop_after_steps": {steps}, "checkpoint_path": None,
                                     "sample_count": 4096}}, log=lambda line: None)
if rank == 0:
    print("RATE", r["global_step"] / r["train_seconds"])
"""


def empty_cells(nb: NotebookKernel, count: int) -> float:
    samples = []
    for _ in range(count):
        t0 = time.perf_counter()
        reply = nb.run("%%distributed\npass")
        samples.append(time.perf_counter() - t0)
        assert reply.status == "ok", reply.text
    return statistics.median(samples)


def train_rate(nb: NotebookKernel, steps: int) -> float:
    reply = nb.run(TRAIN.format(steps=steps), timeout=600)
    match = re.search(r"RATE ([\d.]+)", reply.text)
    if reply.status != "ok" or match is None:
        raise RuntimeError(reply.text)
    return float(match.group(1))


def spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=float, default=1.0)
    ns = parser.parse_args()
    nb = NotebookKernel(env={"CLORCH_SPARES": "0"})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        started = nb.run(f"%clorch start --nproc {ns.nproc}" + ("" if _gpus() else " --backend gloo"))
        assert started.status == "ok", started.text
        print(started.text.strip().splitlines()[-1])
        train_rate(nb, 50)  # warm: imports, first allocations
        results: dict[str, dict[str, list[float]]] = {"closed": {"cell": [], "rate": []},
                                                      "open": {"cell": [], "rate": []}}
        for r in range(ns.rounds):
            order = ["closed", "open"] if r % 2 == 0 else ["open", "closed"]
            for state in order:
                if state == "open":
                    assert nb.run(f"%clorch top --interval {ns.interval}").status == "ok"
                results[state]["cell"].append(empty_cells(nb, ns.cells))
                results[state]["rate"].append(train_rate(nb, ns.steps))
                if state == "open":
                    assert nb.run("%clorch top --stop").status == "ok"
            print(f"round {r + 1}: " + "; ".join(
                f"{s}: cell {results[s]['cell'][-1] * 1e3:.2f} ms, {results[s]['rate'][-1]:.1f} steps/s" for s in order))
        cell_ratio = [o / c for o, c in zip(results["open"]["cell"], results["closed"]["cell"])]
        rate_ratio = [o / c for o, c in zip(results["open"]["rate"], results["closed"]["rate"])]
        print(f"\n{ns.nproc} ranks, {ns.rounds} rounds, panel every {ns.interval} s; median [min-max]")
        print(f"  empty cell    closed {spread([x * 1e3 for x in results['closed']['cell']], '.2f')} ms   "
              f"open {spread([x * 1e3 for x in results['open']['cell']], '.2f')} ms   open/closed "
              f"{spread(cell_ratio, '.3f')}")
        print(f"  training loop closed {spread(results['closed']['rate'], '.1f')} steps/s   "
              f"open {spread(results['open']['rate'], '.1f')} steps/s   open/closed {spread(rate_ratio, '.3f')} "
              "(target >= 0.99)")
        nb.run("%clorch stop")
    finally:
        nb.shutdown()
    return 0


def _gpus() -> int:
    sys.path.insert(0, ROOT)
    from clorch_repl import cuda

    return cuda.device_count()


if __name__ == "__main__":
    sys.exit(main())
