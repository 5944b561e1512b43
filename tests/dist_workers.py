"""Functions that launched ranks run in the distributed tests (importable by the ranks because
launch passes the caller's sys.path, which holds this folder under pytest), plus the inputs they
use, so the tests can compute the expected results in one process."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import time
import warnings
from typing import Any

import torch

from clorch_repl import distributed as dist
from clorch_repl.distributed import CollectiveMismatch
from clorch_repl.errors import ConfigError

# dtype -> ops checked with all_reduce (and, through the emulated routes, again)
ALL_REDUCE_CASES = {
    "float32": ["sum", "avg", "min", "max", "prod"],
    "int64": ["sum", "avg", "min", "max", "prod", "band", "bor", "bxor"],
    "bool": ["band", "bor", "bxor"],
}
REDUCE_CASES = {"float32": ["sum", "avg", "max"], "int64": ["avg", "band", "bxor"]}
REDUCE_SCATTER_CASES = {"float32": ["sum", "avg", "max"], "int64": ["sum", "avg", "band", "bxor"], "bool": ["bor"]}
EMULATED = ["avg", "band", "bor", "bxor"]
CHUNK = 3


DEV = torch.device("cpu")  # the rank's device; set by the suites (a CUDA device on NCCL)


def _set_device(ctx: dict[str, Any]) -> None:
    global DEV
    DEV = torch.device("cuda", torch.cuda.current_device()) if ctx["backend"] == "nccl" else torch.device("cpu")


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def make_input(rank: int, dtype: str, numel: int = 6, device: torch.device | None = None) -> torch.Tensor:
    """Distinct per rank, with negative odd integers so avg's rounding shows."""
    base = torch.arange(numel, dtype=torch.int64)
    if dtype == "bool":
        out = (base + rank) % 3 == 0
    else:
        out = (base - 3) * (rank + 2) + rank * 3 + 1  # e.g. -5, -3, ... on rank 0; -8, -5, ... on rank 1
        if dtype == "float32":
            out = out.to(torch.float32) / 4
    return out.to(device or torch.device("cpu"))


def a2a_splits(rank: int, world: int) -> tuple[list[int], list[int]]:
    """Uneven, asymmetric split sizes: rank r sends 1 + i + 2r rows to rank i."""
    send = [1 + i + 2 * rank for i in range(world)]
    receive = [1 + rank + 2 * i for i in range(world)]
    return send, receive


def a2a_input(rank: int, world: int, device: torch.device | None = None) -> torch.Tensor:
    send, _ = a2a_splits(rank, world)
    rows = [torch.tensor([[100.0 * rank + 10 * i + k, -1.0]]) for i in range(world) for k in range(send[i])]
    return torch.cat(rows).to(device or torch.device("cpu"))


def _ops_run(r: int, n: int, tag: str, out: dict[str, Any]) -> None:
    for dtype, ops in ALL_REDUCE_CASES.items():
        for op in ops:
            for async_op in (False, True):
                t = make_input(r, dtype, device=DEV)
                work = dist.all_reduce(t, op=op, async_op=async_op)
                if async_op:
                    assert isinstance(work, dist.Work), work
                    assert work.wait(timeout=60) is True
                else:
                    assert work is None
                out[f"{tag}/all_reduce/{dtype}/{op}/{async_op}"] = t
    for dtype, ops in REDUCE_CASES.items():
        for op in ops:
            for async_op in (False, True):
                t = make_input(r, dtype, device=DEV)
                work = dist.reduce(t, op=op, root=n - 1, async_op=async_op)
                if async_op:
                    work.wait()
                if r == n - 1:
                    out[f"{tag}/reduce/{dtype}/{op}/{async_op}"] = t
    for dtype, ops in REDUCE_SCATTER_CASES.items():
        for op in ops:
            for async_op in (False, True):
                inp = make_input(r, dtype, numel=CHUNK * n, device=DEV)
                o = torch.empty(CHUNK, dtype=inp.dtype, device=DEV)
                work = dist.reduce_scatter_into(o, inp, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                out[f"{tag}/reduce_scatter/{dtype}/{op}/{async_op}"] = o


def _errors_run(r: int, n: int, out: dict[str, Any]) -> None:
    def refused(key: str, fn: Any, kind: type[BaseException]) -> None:
        try:
            fn()
        except kind as exc:
            out[key] = str(exc)
        else:
            out[key] = None

    refused("err/unknown_op", lambda: dist.all_reduce(torch.ones(2, device=DEV), op="median"), ConfigError)
    refused("err/band_float", lambda: dist.all_reduce(torch.ones(2, device=DEV), op="band"), ConfigError)
    vec = functools.partial(torch.ones, device=DEV)
    buf = functools.partial(torch.empty, device=DEV)
    refused("err/gather_size", lambda: dist.all_gather_into(buf(3), vec(2)), CollectiveMismatch)
    refused("err/gather_dtype", lambda: dist.all_gather_into(buf(2 * n, dtype=torch.int64), vec(2)),
            CollectiveMismatch)
    refused("err/scatter_size", lambda: dist.reduce_scatter_into(buf(2), vec(3)), CollectiveMismatch)
    refused("err/a2a_sum", lambda: dist.all_to_all_single(torch.empty(4 * n, device=DEV), torch.ones(4 * n, device=DEV),
                                                          [4] * n, [5] + [4] * (n - 1)), CollectiveMismatch)
    refused("err/a2a_len", lambda: dist.all_to_all_single(torch.empty(4, device=DEV), torch.ones(4, device=DEV),
                                                          [2] * (n + 1), [2] * (n + 1)), CollectiveMismatch)
    # Nothing was sent: the group still works, in step.
    t = torch.ones(2, device=DEV)
    dist.all_reduce(t)
    out["err/after"] = t


def _check_run(r: int, n: int, out: dict[str, Any]) -> None:
    """Needs two ranks (one to differ)."""
    if n < 2:
        return
    dist.check_mode(True)
    try:
        try:
            dist.all_reduce(torch.zeros(4 + r, device=DEV))  # rank 1 passes a different shape
        except CollectiveMismatch as exc:
            out["check/shape"] = (str(exc), list(exc.ranks))
        send, receive = ([2, 2], [2, 2]) if r == 0 else ([2, 2], [1, 3])
        try:
            dist.all_to_all_single(torch.zeros(4, device=DEV), torch.zeros(4, device=DEV), receive, send)
        except CollectiveMismatch as exc:
            out["check/splits"] = (str(exc), list(exc.ranks))
        try:
            if r == 0:
                dist.send(torch.zeros(3, device=DEV), dst=1)
            elif r == 1:
                dist.recv(torch.zeros(4, device=DEV), src=0)
        except CollectiveMismatch as exc:
            out["check/p2p"] = str(exc)
        try:  # only rank 1's output is the wrong size: a check local to rank 1 alone would leave
            # rank 0 waiting in the exchange; the cross-rank check comes first and fails both
            dist.all_gather_into(torch.zeros(4 if r == 0 else 3, device=DEV), torch.ones(2, device=DEV))
        except CollectiveMismatch as exc:
            out["check/one-sided"] = (str(exc), list(exc.ranks))
        t = torch.ones(3, device=DEV)
        dist.all_reduce(t, op="sum")  # a matching call passes the check
        out["check/ok"] = t
    finally:
        dist.check_mode(False)


def collectives_suite(ctx: dict[str, Any]) -> dict[str, Any]:
    """Every collective and op, sync and async, native and emulated routes, with warnings as errors."""
    r, n = ctx["rank"], ctx["world_size"]
    _set_device(ctx)
    assert (dist.rank(), dist.world_size()) == (r, n)
    out: dict[str, Any] = {"backend": ctx["backend"], "args": ctx["args"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ops_run(r, n, "native", out)
        dist.emulate(EMULATED)
        try:
            _ops_run(r, n, "emulated", out)
        finally:
            dist.emulate(None)
        for async_op in (False, True):
            t = make_input(r, "float32", device=DEV)
            w = dist.broadcast(t, root=n - 1, async_op=async_op)
            if async_op:
                w.wait()
            out[f"broadcast/{async_op}"] = t
            flat = torch.empty(n * 6, device=DEV)
            w = dist.all_gather_into(flat, make_input(r, "float32", device=DEV), async_op=async_op)
            if async_op:
                w.wait()
            out[f"all_gather/flat/{async_op}"] = flat
            stacked = torch.empty(n, 6, device=DEV)
            w = dist.all_gather_into(stacked, make_input(r, "float32", device=DEV), async_op=async_op)
            if async_op:
                w.wait()
            out[f"all_gather/stacked/{async_op}"] = stacked
            send, receive = a2a_splits(r, n)
            o = torch.empty(sum(receive), 2, device=DEV)
            w = dist.all_to_all_single(o, a2a_input(r, n, DEV), receive, send, async_op=async_op)
            if async_op:
                w.wait()
            out[f"a2a/{async_op}"] = o
            even = torch.empty(2 * n, device=DEV)
            w = dist.all_to_all_single(even, torch.arange(2.0 * n, device=DEV) + 10 * r, async_op=async_op)
            if async_op:
                w.wait()
            out[f"a2a_even/{async_op}"] = even
        # point to point, both directions, sync and async
        payload = torch.arange(5.0, device=DEV) * 7
        if n < 2:
            pass
        elif r == 0:
            dist.send(payload, dst=1)
            back = torch.zeros(5, device=DEV)
            dist.recv(back, src=1, async_op=True).wait()
            out["p2p/back"] = back
        elif r == 1:
            got = torch.zeros(5, device=DEV)
            out["p2p/src"] = dist.recv(got, src=0)
            out["p2p/got"] = got
            dist.send(got + 1, dst=0, async_op=True).wait()
        assert dist.barrier() is None
        work = dist.barrier(async_op=True)
        work.wait(timeout=30)
        out["barrier/completed"] = work.is_completed()
        t = make_input(r, "float32", device=DEV)
        dist.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        out["reduceop/max"] = t
        _errors_run(r, n, out)
        _check_run(r, n, out)
    return to_cpu(out)


def train_small(ctx: dict[str, Any]) -> dict[str, Any]:
    """Data-parallel linear regression: each rank its own data, gradients averaged with all_reduce."""
    r = ctx["rank"]
    _set_device(ctx)
    steps = int(ctx["args"]["steps"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to(DEV)
    with dist.process_group() as pg:  # inside a launched rank: the existing group, left running
        assert pg is ctx["process_group"]
    assert torch.distributed.is_initialized()
    gen = torch.Generator().manual_seed(100 + r)
    true_w = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    x = torch.randn(64, 4, generator=gen)
    y = (x @ true_w.T + 0.25).to(DEV)
    x = x.to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op="avg")
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op="avg")
        losses.append(float(global_loss))
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    print(f"rank {r} final loss {losses[-1]:.5f}")
    return {"losses": losses, "params": params.tolist()}


def fail_one(ctx: dict[str, Any]) -> None:
    """``args.fail_rank`` raises or SIGKILLs itself after a barrier; the others either sleep (so
    only the job can end them) or wait in a collective (so they fail in cascade)."""
    r, args = ctx["rank"], ctx["args"]
    _set_device(ctx)
    dist.barrier()
    if r == args["fail_rank"]:
        print(f"rank {r} about to fail", flush=True)
        if args["how"] == "raise":
            raise ValueError(f"boom from rank {r}")
        os.kill(os.getpid(), signal.SIGKILL)
    if args["others"] == "sleep":
        time.sleep(600)
    else:
        t = torch.ones(1, device=DEV)
        dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()  # NCCL returns at once; wait here, in the collective
        time.sleep(600)


def chatty_then_sleep(ctx: dict[str, Any]) -> None:
    """Python prints, raw fd writes and C stdio, then a marker, then wait to be stopped."""
    r = ctx["rank"]
    print(f"python print from rank {r}")
    os.write(1, f"fd1 write from rank {r}\n".encode())
    os.write(2, f"fd2 write from rank {r}\n".encode())
    libc = ctypes.CDLL(None)
    libc.printf(f"libc printf from rank {r}\n".encode())
    libc.fflush(None)
    print(f"READY {r}", flush=True)
    time.sleep(600)


def lifecycle_script() -> dict[str, Any]:
    """Run in a plain process with no launcher variables: a one-rank world, entered three times."""
    import torch.distributed as tdist

    seen: dict[str, Any] = {}
    with dist.process_group(backend="gloo", timeout=30) as pg:
        t = torch.ones(3)
        dist.all_reduce(t, op="avg")
        seen["first"] = (tdist.get_backend(pg), dist.rank(), dist.world_size(), t.tolist())
    seen["after_normal_exit"] = tdist.is_initialized()
    try:
        with dist.process_group(check=True):
            seen["check_inside"] = dist.check_mode()
            dist.barrier()
            raise KeyError("user error")
    except KeyError:
        seen["error_propagated"] = True
    seen["after_error_exit"] = tdist.is_initialized()
    seen["check_after"] = dist.check_mode()
    with dist.process_group():  # again, after an abort
        t = torch.full((2,), 5.0)
        dist.all_reduce(t, op="max")
        with dist.process_group() as inner:  # nested: the existing group, left alone
            seen["nested_is_world"] = inner is torch.distributed.group.WORLD
        seen["after_nested"] = tdist.is_initialized()
        seen["third"] = t.tolist()
    seen["after_third"] = tdist.is_initialized()
    return seen


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(lifecycle_script()))
    sys.stdout.flush()
