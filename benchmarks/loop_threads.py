"""Where a launch-bound training loop's time goes in a rank, beside the same loop under torchrun.

    python benchmarks/loop_threads.py [--nproc 2] [--rounds 3] [--epochs 30] [--start-args "--spares 0"]
                                      [--torchrun-one-gpu]

The loop is the example's (``clorch_repl.examples.distributed_training.train``: a tiny MLP, a
``loss.item()`` every micro-step), the one of ``benchmarks/training.py``'s launch-bound case. Each
round runs it in a ``%%distributed`` cell of a real notebook kernel and in a torchrun launch (who
goes first alternates), and both sides report, measured inside rank 0 around the loop itself:
steps per second; the CPU time (clock ticks, 10 ms each) and the voluntary/involuntary context
switches of every thread of the process, from ``/proc/self/task``; and the time spent in Python's
garbage collector (``gc.callbacks``). A thread that takes CPU or the GIL from the loop shows there,
so the comparison says whether the rank's own threads (ipykernel's control, IOPub and heartbeat
threads, clorch's watchdog) cost the loop anything, rather than inferring it from rates that swing
from round to round. To test one difference between the two sides at a time:
``CLORCH_FLIGHT_RECORDER=0`` in the environment turns the ranks' recording off (torchrun's workers
keep torch's default), and ``--torchrun-one-gpu`` shows each torchrun worker only its own GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _threads() -> dict[str, tuple[str, int, int, int]]:
    """tid -> (name, CPU ticks, voluntary, involuntary context switches) of this process's threads."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/self/task/{tid}/status") as fh:
                switches = [int(line.split()[1]) for line in fh if "ctxt_switches" in line]
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(tid) or stat[stat.index("(") + 1:stat.rindex(")")]
        out[tid] = (name, int(fields[11]) + int(fields[12]), switches[0], switches[1])
    return out


def probe(rank: int, world_size: int, device: Any, epochs: int) -> dict[str, Any]:
    """Run the loop once in this rank and report what happened around it (see the docstring)."""
    from clorch_repl.examples.distributed_training import train

    pauses = [0.0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[0] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)
    try:
        before = _threads()
        record = train(rank, world_size, device, {"epochs": epochs}, log=lambda s: None)
        after = _threads()
    finally:
        gc.callbacks.remove(on_gc)
    threads = {}
    for tid, (name, ticks, vol, invol) in after.items():
        _, t0, v0, i0 = before.get(tid, (name, 0, 0, 0))
        threads[f"{name}#{tid}" if name in {n for t, (n, *_) in after.items() if t != tid} else name] = \
            [ticks - t0, vol - v0, invol - i0]
    return {"steps_per_s": record["global_step"] / record["train_seconds"], "seconds": record["train_seconds"],
            "gc_ms": pauses[0] * 1e3, "threads": threads}


TORCHRUN = textwrap.dedent("""
    import json, os, sys
    if {one_gpu!r}:  # as a clorch rank sees it: its own GPU only, as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]
        os.environ["LOCAL_RANK"] = "0"
    import torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    from benchmarks.loop_threads import probe
    nccl = torch.cuda.is_available()
    if nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if nccl else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    probe(dist.get_rank(), dist.get_world_size(), device, 1)  # warm-up: the process is new
    result = probe(dist.get_rank(), dist.get_world_size(), device, {epochs})
    if dist.get_rank() == 0:
        print("RESULT", json.dumps(result), flush=True)
    dist.destroy_process_group()
""")

CELL = ("%%distributed\nimport json, sys\nsys.path.insert(0, {root!r})\nfrom benchmarks.loop_threads import probe\n"
        "result = probe(rank, world_size, device, {epochs})\nif rank == 0: print('RESULT', json.dumps(result))")


def torchrun_round(nproc: int, epochs: int, one_gpu: bool = False) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(TORCHRUN.format(root=ROOT, epochs=epochs, one_gpu=one_gpu))
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", fh.name], capture_output=True, text=True)
    finally:
        os.unlink(fh.name)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"torchrun failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def summary(side: str, result: dict[str, Any]) -> str:
    threads = result["threads"]
    main = threads.get("MainThread", [0, 0, 0])
    others = {name: v for name, v in threads.items() if name != "MainThread" and v[0] > 0}
    busy = ", ".join(f"{name} {v[0]} ticks" for name, v in sorted(others.items(), key=lambda kv: -kv[1][0]))
    return (f"{side:<10} {result['steps_per_s']:7.1f} steps/s  loop {result['seconds']:.2f} s  gc {result['gc_ms']:.1f} ms  "
            f"main thread {main[0]} ticks, switches {main[1]} voluntary / {main[2]} involuntary; "
            f"other threads with CPU: {busy or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--start-args", default="", help="more options for %%clorch start")
    parser.add_argument("--torchrun-one-gpu", action="store_true",
                        help="give each torchrun worker only its own GPU (CUDA_VISIBLE_DEVICES), as clorch's ranks have")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from notebook_kernel import NotebookKernel

    nb = NotebookKernel()
    ratios = []
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        start = nb.run(f"%clorch start --nproc {args.nproc} {args.start_args}".rstrip(), timeout=300)
        assert start.status == "ok", start.text
        cell = CELL.format(root=ROOT, epochs=args.epochs)
        assert nb.run(CELL.format(root=ROOT, epochs=1), timeout=300).status == "ok"  # warm-up
        for i in range(args.rounds):
            got = {}
            for side in (("notebook", "torchrun") if i % 2 == 0 else ("torchrun", "notebook")):
                if side == "torchrun":
                    got[side] = torchrun_round(args.nproc, args.epochs, args.torchrun_one_gpu)
                else:
                    reply = nb.run(cell, timeout=600)
                    assert reply.status == "ok", reply.text
                    got[side] = json.loads(reply.text.split("RESULT ", 1)[1].splitlines()[0])
            ratios.append(got["notebook"]["steps_per_s"] / got["torchrun"]["steps_per_s"])
            print(f"round {i + 1}:")
            for side in ("torchrun", "notebook"):
                print("  " + summary(side, got[side]))
        nb.run("%clorch stop")
    finally:
        nb.shutdown()
    print(f"\nnotebook/torchrun steps/s, rank 0: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
