"""Cost of torch's flight recorder (on in every rank, for hang diagnosis), recording on vs off.

    python benchmarks/recording.py [--rounds 7] [--cells 40] [--sizes-mb 1,4,16] [--round-s 0.5]
                                   [--parts collectives,cells,answer] [--entries 2500]

1. gloo all_reduce of 1 MB and up between 2 plain rank processes: one pair records, one pair does
   not (CLORCH_FLIGHT_RECORDER=0), driven in alternating rounds so both see the same machine.
2. The empty ``%%distributed`` cell's round trip, as a Jupyter client sees it: two notebook
   kernels, each with a 2-rank session, one recording and one not, again in alternating rounds.

3. What the notebook's hang check costs a rank (``--parts answer``): ``probe.answer`` as the
   check asks it, whole (every flight-recorder entry) and light (the groups' status only), in a
   1-rank group (NCCL where CUDA is visible, else gloo) after ``--entries`` all_reduces, so the
   recorder's buffer (2,000 entries) is full. The check asks the light question every few seconds
   of a quiet cell and the whole one only while a rank's collectives stand still.

Prints, per case, the median time on and off and the ratio on/off (the median over rounds of
each round's ratio, with the lowest and highest round), and the ratio of the best rounds.
Targets (issue 9): collectives within 1.01, the empty cell within 1.03. Run it on a quiet machine
(see ``uptime``): on a busy one the 2-rank ratios swing by more than 1% from round to round, so it
also measures what recording adds to one call where nothing else costs (a 1-rank group, 4 bytes)
and states that as a share of each 2-rank all_reduce.
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
rank, world = int(sys.argv[1]), int(sys.argv[3])
dist.init_process_group("gloo", rank=rank, world_size=world, init_method="tcp://127.0.0.1:" + sys.argv[2],
                        timeout=datetime.timedelta(seconds=120))
dist.barrier()
print(json.dumps({"ready": True, "recording": record.read()[0] is not None}), flush=True)
for line in sys.stdin:
    kb, iters = (int(x) for x in line.split())
    t = torch.ones(max(1, kb * 1024 // 4))
    dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    dist.barrier()
    print(json.dumps({"s": (time.perf_counter() - t0) / iters}), flush=True)
dist.destroy_process_group()
"""


ANSWER_COST = r"""
import json, sys, time
from clorch_repl.diagnosis import probe, record
record.enable()
import torch, torch.distributed as dist
nccl = torch.cuda.is_available()
if nccl:
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if nccl else "gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1],
                        **({"device_id": torch.device("cuda", 0)} if nccl else {}))
t = torch.ones(4, device="cuda" if nccl else "cpu")
for _ in range(int(sys.argv[2])):
    dist.all_reduce(t)
if nccl:
    torch.cuda.synchronize()
time.sleep(1.0)  # NCCL's watchdog marks the last ones completed
out = {"backend": "nccl" if nccl else "gloo", "entries": len(record.read()[0]["entries"])}
for name, request in (("whole", {}), ("light", {"light": True})):
    out[name] = []
    for _ in range(int(sys.argv[3])):
        t0 = time.perf_counter()
        probe.answer(request)
        out[name].append(time.perf_counter() - t0)
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def answer_cost(entries: int, repeats: int) -> None:
    """Part 3: the hang check's two questions, timed in a rank's process (see the docstring)."""
    from clorch_repl.common.procs import free_port

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CLORCH_FLIGHT_RECORDER", None)
    out = subprocess.run([sys.executable, "-c", ANSWER_COST, str(free_port()), str(entries), str(repeats)],
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"the answer-cost process failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nhang check's answer, 1-rank {got['backend']} group, {got['entries']} recorded entries, {repeats} each "
          f"(median [min-max]):")
    for name in ("whole", "light"):
        ms = [x * 1e3 for x in got[name]]
        print(f"  {name:<6} {statistics.median(ms):8.2f} ms [{min(ms):.2f}-{max(ms):.2f}]")
    print(f"  whole/light: {statistics.median(got['whole']) / statistics.median(got['light']):.0f}x")


def summary(on: list[float], off: list[float]) -> str:
    """Median ratio of the rounds (and its range), and the ratio of the best rounds: on a shared
    machine the best round is the one least disturbed by others, the usual microbenchmark estimate."""
    ratios = [a / b for a, b in zip(on, off)]
    return (f"median on {statistics.median(on) * 1e3:.4f} ms off {statistics.median(off) * 1e3:.4f} ms, "
            f"ratio {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
            f"best on {min(on) * 1e3:.4f} ms off {min(off) * 1e3:.4f} ms, ratio {min(on) / min(off):.3f}")


class Pair:
    """``world`` gloo rank processes that run all_reduce loops on request."""

    def __init__(self, recording: bool, world: int = 2) -> None:
        from clorch_repl.common.procs import free_port

        env = dict(os.environ, PYTHONPATH=ROOT)
        if recording:
            env.pop("CLORCH_FLIGHT_RECORDER", None)
        else:
            env["CLORCH_FLIGHT_RECORDER"] = "0"
            for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
                env.pop(name, None)
        port = str(free_port())
        self.procs = [subprocess.Popen([sys.executable, "-c", RANK_LOOP, str(r), port, str(world)], env=env,
                                       text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                      for r in range(world)]
        hello = [json.loads(p.stdout.readline()) for p in self.procs]
        assert all(h["recording"] == recording for h in hello), hello

    def run(self, kb: int, iters: int) -> float:
        for p in self.procs:
            p.stdin.write(f"{kb} {iters}\n")
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


def alternate(pairs: dict[bool, Pair], kb: int, iters: int, rounds: int) -> dict[bool, list[float]]:
    """Per-call seconds, recording on and off, in alternating rounds (order flipped each round)."""
    for rec in pairs:
        pairs[rec].run(kb, max(1, iters // 10))  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds):
        for rec in ((True, False) if i % 2 == 0 else (False, True)):
            times[rec].append(pairs[rec].run(kb, iters))
    return times


def collectives(sizes_mb: list[int], rounds: int, round_s: float) -> None:
    # What recording adds per call, free of network time: a 1-rank group's all_reduce of 1 float.
    solo = {True: Pair(True, world=1), False: Pair(False, world=1)}
    try:
        probe = solo[False].run(0, 2000)
        times = alternate(solo, 0, max(2000, int(round_s / probe)), rounds)
        added = min(times[True]) - min(times[False])
        print(f"per call, 1 rank, 4 bytes: {summary(times[True], times[False])}; "
              f"added {added * 1e6:+.1f} us per collective")
    finally:
        for pair in solo.values():
            pair.close()
    pairs = {True: Pair(True), False: Pair(False)}
    try:
        for mb in sizes_mb:
            probe = pairs[False].run(mb * 1024, 3)
            iters = max(5, int(round_s / probe))
            times = alternate(pairs, mb * 1024, iters, rounds)
            off = min(times[False])
            print(f"all_reduce {mb:>3} MB (gloo, 2 ranks, {iters} per round): {summary(times[True], times[False])}; "
                  f"the per-call cost above is {added / off * 100:.2f}% of it")
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
            check = kernel.run("%%distributed\nfrom clorch_repl.diagnosis import record\n"
                               "print('FR', record.read()[0] is not None)")
            assert f"FR {rec}" in check.text, check.text
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
        print(f"empty %%distributed cell (2 ranks, median of {n_cells} per round): "
              f"{summary(times[True], times[False])}")
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
    parser.add_argument("--round-s", type=float, default=0.5, help="seconds of collectives per round and case")
    parser.add_argument("--parts", default="collectives,cells,answer",
                        help="which parts to run (see above), comma-separated")
    parser.add_argument("--entries", type=int, default=2500, help="answer: all_reduces recorded before timing")
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"collectives", "cells", "answer"}
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; the parts are collectives, cells, answer")
    if "collectives" in parts:
        collectives([int(s) for s in args.sizes_mb.split(",")], args.rounds, args.round_s)
    if "cells" in parts:
        cells(args.cells, args.rounds)
    if "answer" in parts:
        answer_cost(args.entries, args.rounds)


if __name__ == "__main__":
    main()
