"""From a hung collective to a usable group: clorch's abort and re-form in place, beside what a user
did before it (``%clorch restart``, then the model and optimizer made again and loaded from a
checkpoint), in one run.

    python benchmarks/recover.py [--nproc 2] [--backend gloo|nccl] [--params-m 20] [--rounds 3]

Each round, in one notebook kernel driving real ranks that hold a model (``--params-m`` million
parameters in Linear layers, DDP, AdamW with its state after one step):

* **recover**: rank 1 sleeps while rank 0 waits in an all_reduce it never joins; the clock starts
  at Kernel > Interrupt (SIGINT to the notebook kernel) and stops when the next cell, an
  all_reduce plus a DDP step on the model that was there before, has finished: the group was
  aborted and formed again, and every rank kept the model.
* **restart + load** (the baseline): the same hang, interrupted the same way; then ``%clorch
  restart`` and a cell that makes the model and optimizer again, loads them from the checkpoint
  written before the round (``clorch_repl.distributed.load_checkpoint``) and takes the same step.
  The clock runs from the interrupt to the end of that cell. The user's own set-up cells (imports
  beyond torch, data) are not counted, which favours the baseline.

Prints each round's seconds, the medians, and the ratio baseline / recover with its spread (the
lowest and highest per-round ratio). Goal (issue 34): the next cell usable within 3 s of the
interrupt on gloo and 2 s on NCCL.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)

MODEL = """%%distributed
import time, torch, torch.distributed as dist
import clorch_repl.distributed as cdist
from torch.nn.parallel import DistributedDataParallel as DDP
def make(width):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    net = torch.nn.Sequential(*layers).to(device)
    model = DDP(net) if device.type == "cpu" else DDP(net, device_ids=[device])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
def train_step(model, opt, width):
    opt.zero_grad()
    model(torch.ones(8, width, device=device)).sum().backward()
    opt.step()
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    return t.item()
"""

HANG = ("%%distributed\nprint('in', flush=True)\nif rank == 1:\n    time.sleep(3600)\nelse:\n"
        "    t = torch.ones(3, device=device)\n    dist.all_reduce(t)\n    t.sum().item()\n")


def run(kernel: NotebookKernel, code: str, timeout: float = 600) -> str:
    reply = kernel.collect(kernel.send(code), timeout=timeout)
    assert reply.status == "ok", f"{code!r} failed:\n{reply.text}"
    return reply.text


def hang_and_interrupt(kernel: NotebookKernel) -> tuple[float, float, str]:
    """Start the hang, interrupt it once both ranks are in it: the time of the interrupt, the
    seconds until the cell's report was shown (the group formed again by then, when clorch did
    it), and the report's text."""
    msg_id = kernel.send(HANG)
    kernel.wait_for_ranks(msg_id, "in", ranks=(0, 1), timeout=120)
    time.sleep(1.0)  # rank 0 is inside the all_reduce
    t0 = time.perf_counter()
    kernel.km.interrupt_kernel()
    reply = kernel.collect(msg_id, timeout=300)
    return t0, time.perf_counter() - t0, reply.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--params-m", type=float, default=20.0, help="million parameters of the model")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    width = max(64, int((args.params_m * 1e6 / 4) ** 0.5))
    folder = tempfile.mkdtemp(prefix="clorch-recover-")
    path = os.path.join(folder, "ckpt")
    kernel = NotebookKernel(env={"CLORCH_SPARES": "1" if args.backend == "nccl" else "0"})
    recover: list[float] = []
    baseline: list[float] = []
    try:
        run(kernel, "%load_ext clorch_repl")
        run(kernel, f"%clorch start --nproc {args.nproc} --backend {args.backend}", timeout=600)
        setup = MODEL + (f"model, opt = make({width})\ntrain_step(model, opt, {width})\n"
                         f"cdist.save_checkpoint({path!r}, model=model, optimizer=opt)\n")
        run(kernel, setup)
        print(f"model: {4 * width * (width + 1) / 1e6:.1f}M parameters on {args.nproc} {args.backend} ranks")
        for i in range(args.rounds):
            t0, reported, text = hang_and_interrupt(kernel)
            formed = re.search(r"formed again in (\d+\.\d) s", text)
            assert formed, f"the group was not formed again:\n{text}"
            t1 = time.perf_counter()
            run(kernel, f"%%distributed\ntrain_step(model, opt, {width})\n")
            recover.append(time.perf_counter() - t0)
            print(f"round {i + 1}: interrupt to the report {reported:.2f} s (abort to formed: {formed[1]} s), "
                  f"then the step {time.perf_counter() - t1:.2f} s", flush=True)

            t0, _, _ = hang_and_interrupt(kernel)
            run(kernel, "%clorch restart", timeout=600)
            run(kernel, MODEL + f"model, opt = make({width})\ncdist.load_checkpoint({path!r}, model=model, "
                                f"optimizer=opt)\ntrain_step(model, opt, {width})\n")
            baseline.append(time.perf_counter() - t0)
            print(f"round {i + 1}: recover {recover[-1]:.2f} s, restart + load {baseline[-1]:.2f} s", flush=True)
    finally:
        try:
            kernel.collect(kernel.send("%clorch stop"), timeout=120)
        finally:
            kernel.shutdown()
    ratios = [b / r for b, r in zip(baseline, recover)]
    print(f"recover: median {statistics.median(recover):.2f} s [{min(recover):.2f}-{max(recover):.2f}]")
    print(f"restart + load: median {statistics.median(baseline):.2f} s [{min(baseline):.2f}-{max(baseline):.2f}]")
    print(f"ratio restart+load / recover: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
