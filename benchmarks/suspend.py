"""Giving the GPUs back and taking them again: ``%clorch suspend`` / ``%clorch resume`` beside the
CUDA driver's bare checkpoint of the same process, and beside what a user does without them
(a sharded save, ``%clorch stop``, ``%clorch start``, make the model again and load), in one run.

    python benchmarks/suspend.py [--gib 20] [--params-m 400] [--rounds 2]

One NCCL rank (needs a GPU and a driver with the checkpoint API) holds a model of ``--params-m``
million parameters, its AdamW state after one step and ``--gib`` GiB of other tensors. Each round:

* **clorch**: ``%clorch suspend`` then ``%clorch resume``, each timed around its cell (the
  notebook's round trip included);
* **bare driver**: from this process, through :class:`clorch_repl.host.cuda_checkpoint.Driver`, lock +
  checkpoint, then restore + unlock of the rank's process with its communicator alive (what
  ``cuda-checkpoint --toggle`` does; no abort, no re-form, no helper process);
* **the user's alternative**: a sharded save of the model and optimizer
  (``cdist.save_checkpoint(..., sharded=True)``) and of the tensors (``torch.distributed.checkpoint``),
  ``%clorch stop`` (the GPU is free here), then ``%clorch start`` and a cell that makes the model
  and optimizer again and loads everything. The user's own set-up cells (imports beyond torch,
  data) are not counted, which favours the alternative.

Prints each round's seconds, the medians, and the ratios with their spread (lowest and highest per
round). Goals (issue 37): suspend and resume within 1.2x of the bare driver's time; resume at
least 2x faster than start + load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)
from rank_text import lines_of  # noqa: E402

from clorch_repl.host import cuda_checkpoint  # noqa: E402

MAKE = """%%distributed
import os, time, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
import clorch_repl.distributed as cdist
def make(width, layers):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
def train_step(model, opt, width):
    opt.zero_grad()
    model(torch.ones(8, width, device=device)).pow(2).mean().backward()
    opt.step()
    torch.cuda.synchronize()
"""


def run(kernel: NotebookKernel, code: str, timeout: float = 600) -> str:
    reply = kernel.collect(kernel.send(code), timeout=timeout)
    assert reply.status == "ok", f"{code!r} failed:\n{reply.text}"
    return reply.text


def timed(kernel: NotebookKernel, code: str, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    run(kernel, code, timeout)
    return time.perf_counter() - t0


def spread(name: str, values: list[float], unit: str = "s") -> str:
    return f"{name}: median {statistics.median(values):.2f} {unit} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=20.0, help="GiB of tensors beside the model")
    parser.add_argument("--params-m", type=float, default=400.0, help="million parameters of the model")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    problem = cuda_checkpoint.api_problem()
    if problem:
        sys.exit(f"benchmarks/suspend.py: {problem}")
    width, layers = 4096, max(1, round(args.params_m * 1e6 / (4096 * 4097)))
    folder = tempfile.mkdtemp(prefix="clorch-suspend-")
    ckpt, tensors = os.path.join(folder, "model"), os.path.join(folder, "tensors")
    state = (f"model, opt = make({width}, {layers})\ntrain_step(model, opt, {width})\n"
             f"big = torch.randn(int({args.gib} * 2**30) // 4, device=device)\ntorch.cuda.synchronize()\n"
             "print('pid', os.getpid(), flush=True)\n")
    kernel = NotebookKernel(env={"CLORCH_SPARES": "0"})  # spares are not what is measured
    rows: dict[str, list[float]] = {k: [] for k in ("suspend", "resume", "bare out", "bare in", "save + stop",
                                                    "start + load")}
    driver = cuda_checkpoint.Driver()
    try:
        run(kernel, "%load_ext clorch_repl")
        run(kernel, "%clorch start --nproc 1 --backend nccl", timeout=600)
        pid = int(lines_of(run(kernel, MAKE + state), 0)[-1].split()[1])
        print(f"rank 0 (pid {pid}): {layers * width * (width + 1) / 1e6:.0f}M parameters + AdamW, "
              f"{args.gib:g} GiB of tensors", flush=True)
        for i in range(args.rounds):
            rows["suspend"].append(timed(kernel, "%clorch suspend"))
            rows["resume"].append(timed(kernel, "%clorch resume"))

            t0 = time.perf_counter()
            driver.suspend(pid, f"rank 0 (pid {pid})")
            rows["bare out"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            driver.resume(pid, f"rank 0 (pid {pid})")
            rows["bare in"].append(time.perf_counter() - t0)

            save = (f"%%distributed\ncdist.save_checkpoint({ckpt!r}, model=model, optimizer=opt, sharded=True)\n"
                    f"dcp.save({{'big': big}}, checkpoint_id={tensors!r})\n")
            rows["save + stop"].append(timed(kernel, save) + timed(kernel, "%clorch stop"))
            load = (MAKE + f"model, opt = make({width}, {layers})\n"
                    f"cdist.load_checkpoint({ckpt!r}, model=model, optimizer=opt)\n"
                    f"big = torch.empty(int({args.gib} * 2**30) // 4, device=device)\n"
                    f"dcp.load({{'big': big}}, checkpoint_id={tensors!r})\ntorch.cuda.synchronize()\n"
                    "print('pid', os.getpid(), flush=True)\n")
            t0 = time.perf_counter()
            run(kernel, "%clorch start --nproc 1 --backend nccl", timeout=600)
            pid = int(lines_of(run(kernel, load), 0)[-1].split()[1])
            rows["start + load"].append(time.perf_counter() - t0)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
    finally:
        try:
            kernel.collect(kernel.send("%clorch stop"), timeout=120)
        finally:
            kernel.shutdown()
            shutil.rmtree(folder, ignore_errors=True)
    for name, values in rows.items():
        print(spread(name, values))
    pairs = (("suspend / bare out", "suspend", "bare out"), ("resume / bare in", "resume", "bare in"),
             ("start+load / resume", "start + load", "resume"), ("save+stop / suspend", "save + stop", "suspend"))
    for label, top, bottom in pairs:
        print(spread(f"ratio {label}", [a / b for a, b in zip(rows[top], rows[bottom])], "x"))


if __name__ == "__main__":
    main()
