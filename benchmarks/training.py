"""Training throughput through ``%%distributed`` beside ``torchrun``, and checkpoint save cost.

    python benchmarks/training.py [--nproc 2] [--rounds 5] [--epochs 12] [--sample-count 4096]
                                  [--precision bfloat16] [--ckpt-params-m 8] [--ckpt-dir DIR]

1. Steps per second of the example's training loop (``examples.distributed_training.train``, no
   checkpoints, no logging) run in a ``%%distributed`` cell of a real notebook kernel driven by
   jupyter_client, beside the same function in a script under ``torchrun``, in the same run and
   interleaved round by round (the median of ``--rounds`` rounds of each). Two notebook rates are
   reported: the loop as timed inside the ranks, and the whole cell as the Jupyter client sees it
   (that one includes the cell's round trip). Target: ratio >= 0.98.
2. ``save_checkpoint`` of a model and its AdamW state beside a plain ``torch.save`` of the same two
   state dicts to the same folder, alternated, median of 7. ``save_checkpoint`` also fsyncs the
   file and the folder and renames atomically; ``torch.save`` does none of that, but it frees the
   previous file's blocks while it truncates it, which ``save_checkpoint`` leaves to a background
   thread. Target <= 1.15x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    from examples.distributed_training import train
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    args = json.loads({args!r})
    train(dist.get_rank(), dist.get_world_size(), device, dict(args, epochs=1), log=lambda s: None)  # warm-up
    dist.barrier()
    record = train(dist.get_rank(), dist.get_world_size(), device, args, log=lambda s: None)
    if dist.get_rank() == 0:
        print("RESULT", json.dumps({{"steps": record["global_step"], "seconds": record["train_seconds"]}}), flush=True)
    dist.destroy_process_group()
""")


def torchrun_round(nproc: int, args: dict) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(TORCHRUN_SCRIPT.format(root=ROOT, args=json.dumps(args)))
        script = fh.name
    try:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={nproc}", script], capture_output=True, text=True, timeout=900,
                             cwd=ROOT)
    finally:
        os.unlink(script)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"torchrun failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    record = json.loads(line[len("RESULT "):])
    return record["steps"] / record["seconds"]


CELL = """%%distributed
import json
from examples.distributed_training import train
_record = train(rank, world_size, device, json.loads({args!r}), log=lambda s: None)
if rank == 0:
    print("RESULT", json.dumps({{"steps": _record["global_step"], "seconds": _record["train_seconds"]}}))
"""


def notebook_round(kernel: NotebookKernel, args: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    reply = kernel.collect(kernel.send(CELL.format(args=json.dumps(args))), timeout=900)
    elapsed = reply.idle_at - t0
    if reply.status != "ok":
        raise RuntimeError(f"the %%distributed cell failed:\n{reply.text[-3000:]}")
    line = next(ln for ln in reply.text.splitlines() if "RESULT " in ln)
    record = json.loads(line.split("RESULT ", 1)[1])
    return record["steps"] / record["seconds"], record["steps"] / elapsed


def bench_training(nproc: int, rounds: int, args: dict) -> dict:
    kernel = NotebookKernel()
    try:
        for line in ("%load_ext clorch_repl", f"%clorch start --nproc {nproc}"):
            reply = kernel.run(line, timeout=600)
            assert reply.status == "ok", reply.text
        print(reply.text.strip())
        notebook_round(kernel, dict(args, epochs=1))  # warm-up, like the script's
        inside, client, script = [], [], []
        for i in range(rounds):
            a, b = notebook_round(kernel, args)
            c = torchrun_round(nproc, args)
            inside.append(a)
            client.append(b)
            script.append(c)
            print(f"round {i + 1}: notebook {a:.1f} steps/s in the ranks, {b:.1f} steps/s as the client sees it; "
                  f"torchrun {c:.1f} steps/s", flush=True)
        kernel.run("%clorch stop")
    finally:
        kernel.shutdown()
    med = {k: statistics.median(v) for k, v in (("inside", inside), ("client", client), ("torchrun", script))}
    return med


def bench_checkpoint(params_m: float, folder: str, repeats: int = 7) -> tuple[float, float, float]:
    import torch

    from clorch_repl.distributed import save_checkpoint

    width = int((params_m * 1e6 / 4) ** 0.5)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    n_params = sum(p.numel() for p in model.parameters())
    plain_path, ours_path = os.path.join(folder, "plain.pt"), os.path.join(folder, "ours.pt")
    plain, ours = [], []
    for i in range(repeats + 1):
        for which in (("plain", "ours") if i % 2 else ("ours", "plain")):  # alternate who goes first
            t0 = time.perf_counter()
            if which == "plain":
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, plain_path)
            else:
                save_checkpoint(ours_path, model=model, optimizer=opt, state={"step": i})
            if i:  # the first pair warms caches and allocators
                (plain if which == "plain" else ours).append(time.perf_counter() - t0)
    size_mb = os.path.getsize(ours_path) / 2 ** 20
    return statistics.median(plain), statistics.median(ours), size_mb if n_params else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--sample-count", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--ckpt-params-m", type=float, default=8.0, help="model size, millions of parameters")
    parser.add_argument("--ckpt-dir", default=None, help="folder for the checkpoint files (default: a temp folder)")
    parser.add_argument("--skip-training", action="store_true")
    ns = parser.parse_args()

    if not ns.skip_training:
        args = {"epochs": ns.epochs, "sample_count": ns.sample_count, "batch_size": ns.batch_size,
                "accumulation": 2, "precision": ns.precision, "checkpoint_path": None}
        med = bench_training(ns.nproc, ns.rounds, args)
        print(f"\ntraining loop, {ns.nproc} ranks, median of {ns.rounds} rounds:")
        print(f"  torchrun script            {med['torchrun']:8.1f} steps/s")
        print(f"  %%distributed (in ranks)   {med['inside']:8.1f} steps/s   ratio {med['inside'] / med['torchrun']:.3f}")
        print(f"  %%distributed (client)     {med['client']:8.1f} steps/s   ratio {med['client'] / med['torchrun']:.3f}"
              "   (target >= 0.98)")

    folder = tempfile.mkdtemp(prefix="clorch-bench-ckpt-", dir=ns.ckpt_dir)
    try:
        plain, ours, size = bench_checkpoint(ns.ckpt_params_m, folder)
    finally:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    print(f"\ncheckpoint of {size:.0f} MiB (model + AdamW state), median of 7:")
    print(f"  torch.save        {plain * 1e3:8.1f} ms")
    print(f"  save_checkpoint   {ours * 1e3:8.1f} ms   ratio {ours / plain:.3f}   (target <= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
