"""Cost of torch's flight recorder (on in every rank, for hang diagnosis), recording on vs off.

    python benchmarks/recording.py [--rounds 7] [--cells 40] [--sizes-mb 1,4,16]

1. gloo all_reduce of 1 MB and up between 2 plain rank processes: one pair records, one pair does
   not (CLORCH_FLIGHT_RECORDER=0), driven in alternating rounds so both see the same machine.
2. The empty ``%%distributed`` cell's round trip, as a Jupyter client sees it: two notebook
   kernels, each with a 2-rank session, one recording and one not, again in alternating rounds.

Prints, per case, the median time on and off and the ratio on/off: the median over rounds of each
round's ratio, with the lowest and highest round. Targets (issue 9): collectives within 1.01, the
empty cell within 1.03.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)

RANK_LOOP = r"""
import datetime, json, os, sys, time
from clorch_repl.diagnosis import record
record.enable()
import torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2],
                        timeout=datetime.timedelta(seconds=120))
dist.barrier()
print(json.dumps({"ready": True, "recording": record.read()[0] is not None}), flush=True)
for line in sys.stdin:
    mb, iters = (int(x) for x in line.split())
    t = torch.ones(mb * 1024 * 1024 // 4)
    dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dist.barrier()
    print(json.dumps({"s": (time.perf_counter() - t0) / iters}), flush=True)
dist.destroy_process_group()
"""


def summary(on: list[float], off: list[float]) -> str:
    ratios = [a / b for a, b in zip(on, off)]
    return (f"on {statistics.median(on) * 1e3:8.3f} ms  off {statistics.median(off) * 1e3:8.3f} ms  "
            f"ratio {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


class Pair:
    """Two gloo rank processes that run all_reduce loops on request."""

    def __init__(self, recording: bool) -> None:
        from clorch_repl.procs import free_port

        env = dict(os.environ, PYTHONPATH=ROOT)
        if recording:
            env.pop("CLORCH_FLIGHT_RECORDER", None)
        else:
            env["CLORCH_FLIGHT_RECORDER"] = "0"
            for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
                env.pop(name, None)
        port = str(free_port())
        self.procs = [subprocess.Popen([sys.executable, "-c", RANK_LOOP, str(r), port], env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE) for r in range(2)]
        hello = [json.loads(p.stdout.readline()) for p in self.procs]
        assert all(h["recording"] == recording for h in hello), hello

    def run(self, mb: int, iters: int) -> float:
        for p in self.procs:
            p.stdin.write(f"{mb} {iters}\n")
            p.stdin.flush()
        return max(json.loads(p.stdout.readline())["s"] for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def collectives(sizes: list[int], rounds: int) -> None:
    pairs = {True: Pair(True), False: Pair(False)}
    try:
        for mb in sizes:
            iters = max(5, 64 // mb)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(rounds):
                order = (True, False) if i % 2 == 0 else (False, True)
                for rec in order:
                    times[rec].append(pairs[rec].run(mb, iters))
            print(f"all_reduce {mb:>3} MB (gloo, 2 ranks, {iters} per round): {summary(times[True], times[False])}")
    finally:
        for pair in pairs.values():
            pair.close()


def cells(n_cells: int, rounds: int) -> None:
    kernels: dict[bool, NotebookKernel] = {}
    saved = os.environ.get("CLORCH_FLIGHT_RECORDER")
    try:
        for rec in (True, False):
            if rec:
                os.environ.pop("CLORCH_FLIGHT_RECORDER", None)
            else:
                os.environ["CLORCH_FLIGHT_RECORDER"] = "0"
            kernel = NotebookKernel()
            kernels[rec] = kernel
            for code in ("%load_ext clorch_repl", "%clorch start --nproc 2"):
                assert kernel.run(code).status == "ok", code
            check = kernel.run("%%distributed\nimport os\nprint('FR', os.environ.get('TORCH_FR_BUFFER_SIZE'))")
            assert ("FR None" in check.text) != rec, check.text
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(rounds + 1):
            order = (True, False) if i % 2 == 0 else (False, True)
            for rec in order:
                samples = []
                for _ in range(n_cells):
                    t0 = time.perf_counter()
                    reply = kernels[rec].collect(kernels[rec].send("%%distributed\npass"), timeout=60)
                    assert reply.status == "ok"
                    samples.append(reply.idle_at - t0)
                if i:  # round 0 warms up
                    times[rec].append(statistics.median(samples))
        print(f"empty %%distributed cell (2 ranks, median of {n_cells} per round): {summary(times[True], times[False])}")
    finally:
        if saved is None:
            os.environ.pop("CLORCH_FLIGHT_RECORDER", None)
        else:
            os.environ["CLORCH_FLIGHT_RECORDER"] = saved
        for kernel in kernels.values():
            kernel.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--sizes-mb", default="1,4,16")
    args = parser.parse_args()
    collectives([int(s) for s in args.sizes_mb.split(",")], args.rounds)
    cells(args.cells, args.rounds)


if __name__ == "__main__":
    main()
