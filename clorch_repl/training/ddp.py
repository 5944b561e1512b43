"""Data-parallel training: torch's DistributedDataParallel with the checks a notebook user needs.

Public name: ``clorch_repl.parallel`` (``from clorch_repl import parallel as ddp``).

A notebook is where replicas drift apart by accident: a cell re-run on one rank, a model rebuilt
with another width, an optimizer stepped inside ``no_sync``. The wrapper here refuses those
mistakes with an error that names the rank, instead of the hang or silent divergence torch gives.
Gradient reduction itself is torch's own ``DistributedDataParallel``; nothing is reimplemented.

Decisions (documented here because the seed differs):

* ``find_unused_parameters`` and ``gradient_as_bucket_view`` are passed through to torch, where
  they work, rather than refused as in the seed (whose own DDP could not support them).
* ``broadcast_buffers`` is the seed's name. torch 2.13 deprecated it for ``forward_sync_buffers``;
  where that exists it is passed instead, so no FutureWarning reaches the user. Buffers are then
  always copied from rank zero once when wrapping (as parameters are); ``broadcast_buffers=False``
  only stops the copy at every forward.
* ``check_reduction`` (deprecated and ignored by torch) is dropped silently. ``mixed_precision``
  (torch's private experimental option) is refused: use :mod:`clorch_repl.amp`.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as tdist
from torch import nn

from ..distributed import _c10d
from ..errors import ClorchError, ConfigError

__all__ = ["distributed_data_parallel", "no_sync", "optimizer_step", "unwrap", "parameter_signature", "is_fsdp"]

_DDP = nn.parallel.DistributedDataParallel
_DDP_PARAMS = frozenset(inspect.signature(_DDP.__init__).parameters) - {"self", "module"}
_REFUSED = {
    "mixed_precision": "use clorch_repl.amp.autocast (and a grad scaler for float16) instead",
    "module": "pass the model as the first argument",
}
_DROPPED = {"check_reduction"}  # deprecated no-ops in torch: accepted, never forwarded

_CLOSED_ATTR = "_clorch_closed"
_SYNC_ATTR = "_clorch_last_forward_synced"


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside a DDP wrapper (or the model itself)."""
    while isinstance(model, _DDP):
        model = model.module
    return model


def parameter_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter, in registration order: what must match across ranks."""
    return [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""))
            for name, p in unwrap(model).named_parameters()]


def _digest(signature: list[tuple[str, tuple[int, ...], str]]) -> str:
    return hashlib.sha256(repr(signature).encode()).hexdigest()


def _first_difference(mine: list, theirs: list) -> str:
    mine_d = {name: (shape, dtype) for name, shape, dtype in mine}
    theirs_d = {name: (shape, dtype) for name, shape, dtype in theirs}
    for name, shape, dtype in mine:
        if name not in theirs_d:
            return f"parameter {name!r} exists on rank 0 but not there"
        if theirs_d[name] != (shape, dtype):
            t_shape, t_dtype = theirs_d[name]
            return (f"parameter {name!r} is {list(shape)} {dtype} on rank 0 "
                    f"but {list(t_shape)} {t_dtype} there")
    for name, _shape, _dtype in theirs:
        if name not in mine_d:
            return f"parameter {name!r} exists there but not on rank 0"
    return "the parameters are registered in a different order"


def _check_signatures(model: nn.Module, group: Any) -> None:
    """Compare every rank's parameter signature with rank zero's before torch does.

    torch's own check fails with a shape-only message and no rank; a mismatched rank in a notebook
    (one rank re-ran a cell with another width) deserves the rank and the parameter.
    """
    signature = parameter_signature(model)
    gathered: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(gathered, (_digest(signature), signature), group=group)
    reference_digest, reference = gathered[0]
    bad = [r for r, (digest, _sig) in enumerate(gathered) if digest != reference_digest]
    if bad:
        rank = bad[0]
        detail = _first_difference(reference, gathered[rank][1])
        others = f" (ranks differing: {', '.join(map(str, bad))})" if len(bad) > 1 else ""
        raise ConfigError(f"rank {rank} has a different model than rank 0: {detail}{others}. "
                          "Build the same model on every rank (re-run the cell on all ranks) "
                          "before wrapping it in distributed_data_parallel")


def _ddp_kwargs(model: nn.Module, bucket_cap_mb: float, broadcast_buffers: bool,
                more: dict[str, Any]) -> dict[str, Any]:
    for name, why in _REFUSED.items():
        if name in more:
            raise ConfigError(f"distributed_data_parallel does not take {name}: {why}")
    unknown = sorted(set(more) - _DDP_PARAMS - _DROPPED)
    if unknown:
        raise ConfigError(f"distributed_data_parallel got unknown option(s) {', '.join(unknown)}; "
                          f"torch {torch.__version__} DistributedDataParallel accepts: "
                          f"{', '.join(sorted(_DDP_PARAMS - set(_REFUSED)))}")
    try:
        bucket = float(bucket_cap_mb)
    except (TypeError, ValueError):
        raise ConfigError(f"bucket_cap_mb must be a number of MiB; got {bucket_cap_mb!r}") from None
    if not bucket > 0:
        raise ConfigError(f"bucket_cap_mb must be positive; got {bucket_cap_mb!r}")
    kwargs = {k: v for k, v in more.items() if k not in _DROPPED}
    kwargs["bucket_cap_mb"] = bucket
    if "forward_sync_buffers" in _DDP_PARAMS:  # torch >= 2.13: broadcast_buffers is deprecated
        if "broadcast_buffers" in kwargs:
            kwargs.pop("broadcast_buffers")
        kwargs.setdefault("forward_sync_buffers", bool(broadcast_buffers))
    else:
        kwargs["broadcast_buffers"] = bool(broadcast_buffers)
    if "device_ids" not in kwargs:
        devices = {p.device for p in model.parameters()}
        if len(devices) == 1:
            (device,) = devices
            if device.type == "cuda":
                kwargs["device_ids"] = [device.index if device.index is not None
                                        else torch.cuda.current_device()]
    return kwargs


@contextlib.contextmanager
def _hooks_snapshot(model: nn.Module) -> Iterator[None]:
    """Remove, on exit, module hooks added while inside (DDP adds some for some options)."""
    names = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    before = {(id(m), n): set(getattr(m, n, {}).keys()) for m in model.modules() for n in names}
    try:
        yield
    finally:
        for module in model.modules():
            for name in names:
                hooks = getattr(module, name, None)
                if hooks is None:
                    continue
                for key in set(hooks.keys()) - before.get((id(module), name), set()):
                    hooks.pop(key, None)


def _closed_forward(*_args: Any, **_kwargs: Any) -> Any:
    raise ClorchError("this DDP model was used after its `with distributed_data_parallel(...)` block "
                      "ended, so its gradients would never be reduced; use the plain model, or wrap "
                      "it again")


@contextlib.contextmanager
def distributed_data_parallel(model: nn.Module, bucket_cap_mb: float = 25.0,
                              broadcast_buffers: bool = True, **more: Any) -> Iterator[nn.Module]:
    """Wrap ``model`` in torch's DistributedDataParallel for the duration of a ``with`` block.

    A context manager because a notebook re-runs cells: leaving the block removes DDP's autograd
    hooks from the parameters (so the plain model no longer waits on a reduction nobody starts)
    and makes the wrapper refuse further use. Every rank must enter it (it is a collective).
    ``**more`` goes to DistributedDataParallel (renamed options are mapped to the running torch).
    """
    if not _c10d.active():
        raise ClorchError("distributed_data_parallel needs an initialised process group: run it in a "
                          "%%distributed cell, a launch() worker, or inside "
                          "clorch_repl.distributed.process_group()")
    if isinstance(model, _DDP):
        raise ConfigError("the model is already wrapped in DistributedDataParallel; pass the plain model")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameters, so there is nothing for DDP to reduce")
    kwargs = _ddp_kwargs(model, bucket_cap_mb, broadcast_buffers, more)
    group = kwargs.get("process_group")
    _check_signatures(model, group)
    with _hooks_snapshot(model):
        pmodel = _DDP(model, **kwargs)
        setattr(pmodel, _SYNC_ATTR, None)

        def record_sync(module: nn.Module, _inputs: Any) -> None:
            if torch.is_grad_enabled():
                setattr(module, _SYNC_ATTR, bool(module.require_backward_grad_sync))

        handle = pmodel.register_forward_pre_hook(record_sync)
        try:
            yield pmodel
        finally:
            handle.remove()
            reducer = getattr(pmodel, "reducer", None)
            if reducer is not None and hasattr(reducer, "_remove_autograd_hooks"):
                reducer._remove_autograd_hooks()
            for accum_hook in getattr(pmodel, "_accum_grad_hooks", []):
                accum_hook.remove()
            setattr(pmodel, _CLOSED_ATTR, True)
            pmodel.forward = _closed_forward  # type: ignore[method-assign]


def _fsdp_module_class() -> type | None:
    """FSDP2's module class (``fully_shard`` turns a module into one), where torch has it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch < 2.6
        except ImportError:
            return None
    return FSDPModule


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard``."""
    cls = _fsdp_module_class()
    return cls is not None and isinstance(model, cls)


_NO_SYNC_ATTR = "_clorch_in_no_sync"


def _record_fsdp_sync(module: nn.Module, _inputs: Any) -> None:
    if torch.is_grad_enabled():
        setattr(module, _SYNC_ATTR, not getattr(module, _NO_SYNC_ATTR, False))


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient reduction for micro-batches before the last one of an accumulation step.

    Forward and backward must both run inside. DDP models skip their all-reduce; FSDP2 models
    (``fully_shard``) their reduce-scatter (``set_requires_gradient_sync(False)``, restored on
    exit). A plain (unwrapped) model is accepted, so the same loop runs in a single process.
    """
    if isinstance(model, _DDP):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        if not hasattr(model, "_clorch_sync_hook"):  # records whether each forward ran inside no_sync
            model._clorch_sync_hook = model.register_forward_pre_hook(_record_fsdp_sync)
        model.set_requires_gradient_sync(False)
        setattr(model, _NO_SYNC_ATTR, True)
        try:
            yield
        finally:
            setattr(model, _NO_SYNC_ATTR, False)
            model.set_requires_gradient_sync(True)
    else:
        yield


def _group_of(model: nn.Module) -> Any:
    if isinstance(model, _DDP):
        return model.process_group
    return None


def _multi_rank(group: Any) -> bool:
    return _c10d.active() and tdist.get_world_size(group) > 1


def _agree_on_overflow(scaler: Any, optimizer: torch.optim.Optimizer, group: Any) -> bool:
    """Make every rank's scaler see the same found-inf flag; returns whether any rank overflowed.

    Gradients reduced by DDP already carry an inf to every rank, but parameters outside DDP, an
    overflow injected after the reduction, or a rank-local loss term do not: without agreement one
    rank steps while another skips and the replicas silently diverge.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None or id(optimizer) not in states or "found_inf_per_device" not in states[id(optimizer)]:
        raise ClorchError(f"torch {torch.__version__}'s GradScaler keeps its overflow flags where "
                          "clorch_repl does not expect them; report this with your torch version")
    flags = list(states[id(optimizer)]["found_inf_per_device"].values())
    if flags:
        local = torch.stack([f.to(flags[0].device, torch.float32).reshape(()) for f in flags]).amax()
    else:  # no gradients on this rank: it still takes part, or the others would wait for it
        local = torch.zeros((), dtype=torch.float32)
    if _multi_rank(group):
        backend = tdist.get_backend(group)
        carrier = local
        if backend == "nccl" and local.device.type != "cuda":
            carrier = local.to(torch.device("cuda", torch.cuda.current_device()))
        elif backend == "gloo" and local.device.type not in ("cpu", "cuda"):
            carrier = local.cpu()
        carrier = carrier.clone()
        tdist.all_reduce(carrier, op=tdist.ReduceOp.MAX, group=group)
        local = carrier.to(local.device)
    for flag in flags:
        flag.copy_(local.to(flag.device, flag.dtype).reshape(flag.shape))
    return bool(local.item() > 0)


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None) -> bool:
    """Step the optimizer once the gradients are reduced; returns False when the step was skipped.

    DDP's backward returns only after its all-reduce finished (FSDP2's after its reduce-scatter),
    so what this adds is the checks a plain ``optimizer.step()`` lacks: refusing to step on
    gradients that were never reduced (the last forward ran inside ``no_sync``), and, with a
    scaler, making every rank agree on overflow so that either all ranks step or all skip, and the scale backs off the same everywhere. With FSDP2
    each rank holds other gradient shards, so an inf in one rank's shard is seen by that rank
    alone: the agreement over the model's group (every rank) is what skips the step everywhere.
    """
    if getattr(model, _CLOSED_ATTR, False):
        raise ClorchError("optimizer_step got a DDP model whose `with distributed_data_parallel(...)` "
                          "block has ended; pass the model yielded by a live block")
    if is_fsdp(model) and getattr(model, _NO_SYNC_ATTR, False):
        raise ClorchError(f"optimizer_step was called inside no_sync on rank {_c10d.rank()}: the gradient shards "
                          "are not reduced across ranks, so stepping would make the ranks diverge; step after "
                          "the last micro-batch, outside no_sync")
    if is_fsdp(model) and getattr(model, _SYNC_ATTR, None) is False:
        raise ClorchError(f"the last forward on rank {_c10d.rank()} ran inside no_sync, so its gradients were "
                          "never reduced across ranks; run the last micro-batch of each step (forward and "
                          "backward) outside no_sync")
    if isinstance(model, _DDP):
        if not model.require_backward_grad_sync:
            raise ClorchError(f"optimizer_step was called inside no_sync on rank {_c10d.rank()}: the gradients "
                              "are not averaged across ranks, so stepping would make the replicas "
                              "diverge; step after the last micro-batch, outside no_sync")
        if getattr(model, _SYNC_ATTR, None) is False:
            raise ClorchError(f"the last forward on rank {_c10d.rank()} ran inside no_sync, so its gradients "
                              "were never averaged across ranks; run the last micro-batch of each "
                              "step (forward and backward) outside no_sync")
    if scaler is None or not scaler.is_enabled():
        optimizer.step()
        return True
    if not _already_unscaled(scaler, optimizer):  # the user may have unscaled to clip gradients
        scaler.unscale_(optimizer)
    overflow = _agree_on_overflow(scaler, optimizer, _group_of(model))
    scaler.step(optimizer)
    scaler.update()
    return not overflow


def _already_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    stage = state.get("stage")
    return getattr(stage, "name", None) == "UNSCALED"

