"""On a CUDA machine: FSDP2 with bf16 on NCCL ranks, sharded checkpoints saved (blocking and
asynchronously) and loaded on the ranks and into an unsharded model in the notebook kernel, and
the training example's ``strategy="fsdp"`` resumed from its sharded checkpoint. Skipped where
there is no GPU (CI); run on the device machine with ``python -m pytest tests/gpu -q -s``."""

from __future__ import annotations

import os
import re

import pytest

from clorch_repl import cuda

pytestmark = pytest.mark.skipif(cuda.device_count() == 0, reason="needs a CUDA GPU")

CELL = """%%distributed
import time, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from clorch_repl import distributed as cdist, parallel
from tests import sharded_helpers as sh
torch.manual_seed(0)
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
                                  for _ in range(8)])
mesh = init_device_mesh("cuda", (world_size,))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
model.to_empty(device=device)
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(4, 256, 1024, device=device)
def step():
    model(x).float().square().mean().backward()
    assert parallel.optimizer_step(model, opt)
    opt.zero_grad(set_to_none=True)
step(); torch.cuda.synchronize()
saved = sh.digest(model, opt)
t0 = time.perf_counter(); cdist.save_checkpoint(PATH, model=model, optimizer=opt, state={"v": 1})
blocking = time.perf_counter() - t0
cdist.save_checkpoint(PATH, model=model, optimizer=opt, state={"v": 1}, async_save=True).wait()  # buffers
saved = sh.digest(model, opt)
t0 = time.perf_counter(); handle = cdist.save_checkpoint(PATH, model=model, optimizer=opt, state={"v": 2},
                                                         async_save=True)
stall = time.perf_counter() - t0
step(); torch.cuda.synchronize()
handle.wait()
fresh = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True)
                              for _ in range(8)]).to(device)
for layer in fresh:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(fresh, mesh=mesh, mp_policy=policy)
fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
state = cdist.load_checkpoint(PATH, model=fresh, optimizer=fresh_opt)
print(f"RESULT exact={sh.digest(fresh, fresh_opt) == saved} state={state} blocking={blocking:.3f} "
      f"stall={stall:.3f} ratio={stall / blocking:.3f} weights={sh.digest(fresh)}")
"""


def test_fsdp_bf16_nccl_sharded_checkpoints_through_the_notebook(tmp_path) -> None:
    from notebook_kernel import NotebookKernel

    path = str(tmp_path / "fsdp-nccl")
    nb = NotebookKernel()
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        started = nb.run("%clorch start")
        assert started.status == "ok" and "nccl" in started.text, started.text
        ran = nb.run(CELL.replace("PATH", repr(path)), timeout=600)
        print(ran.text)
        assert ran.status == "ok", ran.text
        results = re.findall(r"RESULT exact=(\w+) state=(\{.*?\}) blocking=([\d.]+) stall=([\d.]+) ratio=([\d.]+) "
                             r"weights=([0-9a-f]+)", ran.text)
        assert results and all(r[0] == "True" and r[1] == "{'v': 2}" for r in results), ran.text
        here = nb.run("import torch\nfrom tests import sharded_helpers as sh\nfrom clorch_repl.distributed import "
                      "load_checkpoint\nm = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(1024, 16, 4096, "
                      "dropout=0.0, batch_first=True) for _ in range(8)])\n"
                      f"print(load_checkpoint({path!r}, model=m), sh.digest(m))")
        print(here.text)
        assert here.status == "ok" and f"{{'v': 2}} {results[0][5]}" in here.text, here.text
        assert nb.run("%clorch stop").status == "ok"
    finally:
        nb.shutdown()


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_example_fsdp_strategy_resumes_from_its_sharded_checkpoint(precision: str, tmp_path) -> None:
    from clorch_repl.examples.distributed_training import run_local

    devices = list(range(cuda.device_count()))
    path = str(tmp_path / f"fsdp-{precision}")
    result = run_local(devices, epochs=2, sample_count=512, precision=precision, strategy="fsdp", checkpoint_path=path)
    print(f"{precision} fsdp: {len(result.losses[0])} steps, final loss {result.final_loss:.5f}, "
          f"skipped {result.skipped_steps[0]}, {result.elapsed_s:.1f}s")
    assert result.backend == "nccl" and os.path.isfile(os.path.join(path, ".metadata"))
    more = run_local(devices, epochs=3, sample_count=512, precision=precision, strategy="fsdp", checkpoint_path=path,
                     resume=True)
    again = run_local(devices, epochs=3, sample_count=512, precision=precision, strategy="fsdp",
                      checkpoint_path=str(tmp_path / "uninterrupted"))
    assert "resumed from" in more.logs[0]
    assert more.param_digests == again.param_digests, "resuming from the sharded checkpoint is not exact"
