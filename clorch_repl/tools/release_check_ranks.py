"""The release check's rank side (:mod:`clorch_repl.release_check`): what its launched job runs on
every rank, each check guarded on its own so that one failing check does not hide the others,
and the rank that fails on purpose for the worker-failure check.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any, Callable

logger = logging.getLogger(__name__)


def _device(ctx: dict[str, Any]) -> Any:
    import torch

    if ctx["backend"] == "nccl":
        # the GPU the job's process group chose (dist.process_group): the only one a main= job's
        # rank sees, or cuda:{LOCAL_RANK} where the rank sees its host's GPUs
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model(device: Any, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)


def _batch(device: Any, n: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 8, generator=g).to(device), torch.randn(n, 1, generator=g).to(device)


def _close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    return bool((a - b).abs().max().item() <= tol)


def _check_collectives(ctx: dict[str, Any], device: Any) -> str:
    import torch

    from .. import distributed as dist

    rank, world = ctx["rank"], ctx["world_size"]
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t, op="sum")
    assert torch.all(t == world * (world + 1) / 2), f"all_reduce sum gave {t.tolist()}"
    t = torch.full((4,), float(rank), device=device)
    dist.all_reduce(t, op="avg")
    assert _close(t, torch.full_like(t, (world - 1) / 2)), f"all_reduce avg gave {t.tolist()}"
    t = torch.full((2,), float(rank), device=device)
    dist.all_reduce(t, op="max")
    assert torch.all(t == world - 1), f"all_reduce max gave {t.tolist()}"
    t = torch.full((3,), float(rank + 10), device=device)
    dist.broadcast(t, root=0)
    assert torch.all(t == 10), f"broadcast gave {t.tolist()}"
    out = torch.zeros(world * 2, device=device)
    dist.all_gather_into(out, torch.full((2,), float(rank), device=device))
    assert out.tolist() == [float(r) for r in range(world) for _ in range(2)], f"all_gather gave {out.tolist()}"
    work = dist.all_reduce(torch.ones(1, device=device), op="sum", async_op=True)
    work.wait()
    dist.barrier()
    return f"all_reduce sum/avg/max (sync and async), broadcast, all_gather, barrier on {world} rank(s)"


def _check_ddp_backward(ctx: dict[str, Any], device: Any) -> str:
    import torch.nn.functional as F

    from .. import parallel

    rank, world = ctx["rank"], ctx["world_size"]
    x, y = _batch(device, 8 * world)
    reference = _model(device)
    F.mse_loss(reference(x), y).backward()
    model = _model(device, seed=rank)  # rank zero's weights must win
    mine = slice(rank * 8, (rank + 1) * 8)
    with parallel.distributed_data_parallel(model) as pmodel:
        F.mse_loss(pmodel(x[mine]), y[mine]).backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    assert diff < 1e-5, f"DDP gradient differs from the full-batch gradient by {diff:.2e}"
    return f"averaged gradients match one process on the whole batch (max diff {diff:.1e})"


def _check_accumulation(ctx: dict[str, Any], device: Any) -> str:
    import torch
    import torch.nn.functional as F

    from .. import parallel

    rank, world = ctx["rank"], ctx["world_size"]
    x, y = _batch(device, 8 * world)
    big = _model(device)
    big_opt = torch.optim.SGD(big.parameters(), lr=0.1)
    F.mse_loss(big(x), y).backward()
    big_opt.step()
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine_x, mine_y = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
    with parallel.distributed_data_parallel(model) as pmodel:
        with parallel.no_sync(pmodel):
            (F.mse_loss(pmodel(mine_x[:4]), mine_y[:4]) / 2).backward()
        (F.mse_loss(pmodel(mine_x[4:]), mine_y[4:]) / 2).backward()
        parallel.optimizer_step(pmodel, opt)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), big.parameters()))
    assert diff < 1e-5, f"accumulated update differs from the large-batch update by {diff:.2e}"
    return f"2 micro-batches with no_sync == one large batch (max diff {diff:.1e})"


def _check_amp_overflow(ctx: dict[str, Any], device: Any) -> str:
    import torch
    import torch.nn.functional as F

    from .. import amp, parallel

    rank, world = ctx["rank"], ctx["world_size"]
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.grad_scaler(initial_scale=1024.0, device=device.type)
    x, y = _batch(device, 8)
    with parallel.distributed_data_parallel(model) as pmodel:
        before = [p.detach().clone() for p in model.parameters()]
        with amp.autocast(device=device.type, dtype="float16"):
            out = pmodel(x)
        amp.backward(scaler, F.mse_loss(out.float(), y))
        if rank == world - 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # overflow on one rank only
        stepped = parallel.optimizer_step(pmodel, opt, scaler=scaler)
        assert not stepped, "a step was taken although a rank overflowed"
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "weights changed on overflow"
        assert scaler.get_scale() == 512.0, f"scale is {scaler.get_scale()} after overflow, expected 512"
        opt.zero_grad()
        with amp.autocast(device=device.type, dtype="bfloat16"):
            out = pmodel(x)
        amp.backward(scaler, F.mse_loss(out.float(), y))
        assert parallel.optimizer_step(pmodel, opt, scaler=scaler), "a normal step was skipped"
    extra = ""
    if device.type == "cuda":
        extra = "; " + _check_fused_attention(device)
    return f"overflow on rank {world - 1} only: every rank skipped, scale 1024 -> 512{extra}"


def _check_fused_attention(device: Any) -> str:
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g).to(device) for _ in range(3))
    reference = torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, dim=-1) @ v
    for dtype in (torch.float16, torch.bfloat16):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype)).float()
        err = (out - reference).abs().max().item()
        assert err < 5e-2, f"scaled_dot_product_attention in {dtype} differs by {err:.2e}"
    return "fused attention float16/bfloat16 ok"


def _check_checkpoint(ctx: dict[str, Any], device: Any) -> str:
    import torch

    from .. import amp, data
    from ..distributed import load_checkpoint, save_checkpoint
    from ..errors import CheckpointError

    rank = ctx["rank"]
    folder = ctx["args"]["folder"]
    path = os.path.join(folder, "check.pt")
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters())
    sampler = data.distributed_sampler(64)
    it = iter(sampler)
    next(it)
    scaler = amp.grad_scaler(device=device.type, initial_scale=256.0)
    save_checkpoint(path, model=model, optimizer=opt, sampler=sampler, scaler=scaler, state={"step": 5})
    fresh = _model(device, seed=99)
    fresh_scaler = amp.grad_scaler(device=device.type)
    state = load_checkpoint(path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()),
                            sampler=data.distributed_sampler(64), scaler=fresh_scaler)
    assert state == {"step": 5}, f"state came back as {state}"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters())), "weights differ"
    assert fresh_scaler.get_scale() == 256.0, "scaler state was not restored"
    bad = os.path.join(folder, "truncated.pt")
    if rank == 0:
        with open(path, "rb") as src, open(bad, "wb") as dst:
            dst.write(src.read()[:200])
    from .. import distributed as dist

    dist.barrier()
    try:
        load_checkpoint(bad, model=fresh)
    except CheckpointError:
        pass
    else:
        raise AssertionError("a truncated checkpoint loaded without an error")
    return "rank-zero atomic save, load on every rank, truncated file refused"


def _check_fsdp_checkpoint(ctx: dict[str, Any], device: Any) -> str:
    """FSDP2 (bf16 parameters on GPU) trained a step, saved sharded and asynchronously, loaded into
    a freshly sharded model: the full tensors must come back bit for bit."""
    import hashlib

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .. import parallel
    from ..distributed import load_checkpoint, save_checkpoint

    path = os.path.join(ctx["args"]["folder"], "fsdp-check")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)

    def sharded(seed: int) -> Any:
        model = _model(device, seed)
        mesh = init_device_mesh(device.type, (ctx["world_size"],))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    def digest(model: Any) -> str:
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.full_tensor().detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    model = sharded(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(device, 8)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    assert parallel.optimizer_step(model, opt), "the FSDP2 step was skipped"
    saved = digest(model)
    handle = save_checkpoint(path, model=model, optimizer=opt, state={"step": 1}, async_save=True)
    handle.wait()
    assert os.path.isfile(os.path.join(path, ".metadata")), "the sharded checkpoint has no DCP metadata"
    fresh = sharded(7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(path, model=fresh, optimizer=fresh_opt) == {"step": 1}
    assert digest(fresh) == saved, "the sharded weights came back different"
    return "FSDP2 step, asynchronous sharded save, exact load"


RANK_CHECKS: list[tuple[str, Callable[[dict[str, Any], Any], str]]] = [
    ("collectives", _check_collectives),
    ("ddp backward", _check_ddp_backward),
    ("gradient accumulation", _check_accumulation),
    ("amp overflow handling", _check_amp_overflow),
    ("checkpoints", _check_checkpoint),
    ("fsdp2 sharded checkpoint", _check_fsdp_checkpoint),
]


def rank_checks(ctx: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every rank-side check in this rank; a failure is recorded, not raised."""
    import warnings

    device = _device(ctx)
    results = []
    for name, fn in RANK_CHECKS:
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                warnings.simplefilter("error", FutureWarning)
                detail, ok = fn(ctx, device), True
        except Exception as exc:
            detail, ok = f"{type(exc).__name__}: {exc}", False
            traceback.print_exc()
        results.append({"name": name, "ok": ok, "detail": detail, "seconds": time.perf_counter() - started})
    return results


def failing_rank(ctx: dict[str, Any]) -> None:
    """The last rank fails; the others wait in a barrier that can never complete."""
    from .. import distributed as dist

    if ctx["rank"] == ctx["world_size"] - 1:
        raise RuntimeError("injected failure (release check)")
    dist.barrier()
    time.sleep(60)
