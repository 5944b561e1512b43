"""On a CUDA machine: %clorch start with NCCL ranks through a real notebook kernel, every collective
and op of clorch_repl.distributed across the GPUs checked against values computed on one GPU, and
status showing the GPUs. Skipped where there is no GPU (CI); run on the device machine with
``python -m pytest tests/gpu -q -s``."""

from __future__ import annotations

import re

import pytest

from clorch_repl import cuda

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

CHECK_ALL = r'''%%distributed
import functools, torch
from clorch_repl import distributed as cd
W = world_size
def inp(r, dtype):
    return (torch.arange(16, device=device) * (r + 1) + r).to(dtype)
def ref(op, dtype):
    stack = torch.stack([inp(r, dtype) for r in range(W)])
    if op in ("band", "bor", "bxor"):
        f = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        return functools.reduce(f, list(stack))
    return {"sum": stack.sum(0), "avg": stack.sum(0) / W, "min": stack.min(0).values,
            "max": stack.max(0).values, "prod": stack.prod(0)}[op]
checked = []
for op in ("sum", "avg", "min", "max", "prod", "band", "bor", "bxor"):
    dtype = torch.int64 if op in ("band", "bor", "bxor") else torch.float32
    for async_op in (False, True):
        t = inp(rank, dtype)
        work = cd.all_reduce(t, op=op, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.allclose(t.double(), ref(op, dtype).double()), (op, async_op, t, ref(op, dtype))
        checked.append(f"all_reduce:{op}{':async' if async_op else ''}")
t = inp(rank, torch.float32); cd.broadcast(t, root=W - 1)
assert torch.equal(t, inp(W - 1, torch.float32)); checked.append("broadcast")
t = inp(rank, torch.float32); cd.reduce(t, op="sum", root=0)
if rank == 0:
    assert torch.allclose(t, ref("sum", torch.float32))
checked.append("reduce")
out = torch.empty(16 * W, device=device); cd.all_gather_into(out, inp(rank, torch.float32))
assert torch.equal(out, torch.cat([inp(r, torch.float32) for r in range(W)])); checked.append("all_gather_into")
big = torch.arange(4 * W, device=device, dtype=torch.float32) + rank
out = torch.empty(4, device=device); cd.reduce_scatter_into(out, big, op="sum")
full = sum(torch.arange(4 * W, device=device, dtype=torch.float32) + r for r in range(W))
assert torch.equal(out, full[4 * rank:4 * rank + 4]); checked.append("reduce_scatter_into")
src = torch.arange(8 * W, device=device, dtype=torch.float32) + 100 * rank
out = torch.empty(8 * W, device=device)
cd.all_to_all_single(out, src, output_split_sizes=[8] * W, input_split_sizes=[8] * W)
expect = torch.cat([(torch.arange(8 * W, device=device, dtype=torch.float32) + 100 * r)[8 * rank:8 * rank + 8]
                    for r in range(W)])
assert torch.equal(out, expect); checked.append("all_to_all_single")
if W > 1:
    t = torch.full((4,), float(rank), device=device)
    if rank == 0:
        cd.send(torch.full((4,), 42.0, device=device), dst=1)
    elif rank == 1:
        cd.recv(t, src=0); assert torch.equal(t, torch.full((4,), 42.0, device=device))
    checked.append("send/recv")
cd.barrier(); cd.barrier(async_op=True).wait(); checked.append("barrier")
assert (cd.rank(), cd.world_size()) == (rank, W)
print(f"on {torch.cuda.get_device_name()}: {len(checked)} checks passed:", " ".join(checked))
'''


def test_nccl_session_runs_every_collective_on_the_gpus() -> None:
    from notebook_kernel import NotebookKernel

    n = cuda.device_count()
    nb = NotebookKernel()
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        start = nb.run("%clorch start")
        print(start.text)
        assert start.status == "ok", start.text
        assert f"{n} rank(s) ready, nccl process group formed" in start.text
        reply = nb.run(CHECK_ALL, timeout=300)
        print(reply.text)
        assert reply.status == "ok", reply.text
        # Every rank printed the same line, so it is shown once under a label naming them all
        # (README "Output of many ranks"): that label is what says every rank passed.
        label = "[rank 0]" if n == 1 else f"[ranks 0-{n - 1}]"
        checks = 22 + (n > 1)  # send/recv needs two ranks
        assert re.search(rf"^{re.escape(label)} on .+: {checks} checks passed: ", reply.text, re.M), reply.text
        assert reply.text.count("checks passed") == 1, reply.text
        status = nb.run("%clorch status")
        print(status.text)
        assert "nccl" in status.text and "cuda:0" in status.text
        assert re.search(r"cuda:0 +nccl +[0-9.]+ [MG]iB +[0-9.]+ [MG]iB", status.text), status.text  # GPU memory shown
        untouched = nb.run("import torch; print('notebook CUDA initialised:', torch.cuda.is_initialized())")
        assert "notebook CUDA initialised: False" in untouched.text
        assert nb.run("%clorch stop").status == "ok"
    finally:
        nb.shutdown()
