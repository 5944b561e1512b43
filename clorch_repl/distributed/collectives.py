"""Collectives in place, with one op vocabulary on every backend.

Ops: ``sum avg min max band bor bxor prod`` (or a ``torch.distributed.ReduceOp``). Where a backend
lacks an op it takes another route with the same result:

* ``avg`` on gloo, and ``avg`` of integer tensors everywhere: a native ``sum``, then a local
  division. Integers divide truncating toward zero (C and NCCL semantics: -7/2 -> -3). Cost: one
  extra elementwise pass over the tensor; no extra communication.
* ``band bor bxor`` on NCCL: an all-gather of every rank's tensor into a ``world_size x tensor``
  buffer, then a local ``torch.bitwise_*`` fold. Cost: ``world_size`` times the tensor's memory
  for the buffer and about ``world_size/2`` times the bytes a ring all-reduce moves.
  ``reduce_scatter_into`` with a bitwise op on NCCL uses an all-to-all instead (same bytes as a
  native reduce-scatter).

The hot path is a cached lookup of the group's backend, a dict lookup of the op and a single
boolean test for check mode; validation beyond that happens only where torch's own error would
be obscure, and costs a few integer comparisons.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

from ..errors import ConfigError
from ._errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, NoProcessGroup

ReduceOp = tdist.ReduceOp

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names; older
# releases only have the old names (and before those, the private *_base ones).
_all_gather_single = (getattr(tdist, "all_gather_single", None) or getattr(tdist, "all_gather_into_tensor", None)
                      or getattr(tdist, "_all_gather_base"))
_reduce_scatter_single = (getattr(tdist, "reduce_scatter_single", None)
                          or getattr(tdist, "reduce_scatter_tensor", None) or getattr(tdist, "_reduce_scatter_base"))

OP_NAMES = ("sum", "avg", "min", "max", "band", "bor", "bxor", "prod")
_NATIVE = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "min": ReduceOp.MIN, "max": ReduceOp.MAX,
           "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR, "prod": ReduceOp.PRODUCT}
_BITWISE: dict[str, Callable[..., torch.Tensor]] = {"band": torch.bitwise_and, "bor": torch.bitwise_or,
                                                    "bxor": torch.bitwise_xor}
# What the user may pass -> canonical name.
_OP_ALIASES: dict[Any, str] = {name: name for name in OP_NAMES}
_OP_ALIASES.update({name.upper(): name for name in OP_NAMES})
_OP_ALIASES.update({"mean": "avg", "product": "prod", "PRODUCT": "prod"})
_OP_ALIASES.update({op: name for name, op in _NATIVE.items()})

# Route of each op per backend kind: "native", "avg" (sum + divide) or "bitwise" (gather + fold).
_ROUTES = {
    "gloo": {**{n: "native" for n in OP_NAMES}, "avg": "avg"},
    "nccl": {**{n: "native" for n in OP_NAMES}, "band": "bitwise", "bor": "bitwise", "bxor": "bitwise"},
}
_ROUTES["other"] = _ROUTES["gloo"]  # unknown backends: assume the smallest op set
_NATIVE_ROUTES = {kind: dict(routes) for kind, routes in _ROUTES.items()}

_CHECK = os.environ.get("CLORCH_DIST_CHECK", "").strip().lower() in ("1", "true", "yes", "on")
_GROUPS: dict[tuple[Any, bool], tuple[str, int, int]] = {}


def check_mode(enabled: bool | None = None) -> bool:
    """Turn the cross-rank check of every collective on or off (None: only report); returns the
    setting now in force. Every rank must make the same choice, since the check is itself a
    collective. Off by default; ``CLORCH_DIST_CHECK=1`` turns it on at import."""
    global _CHECK
    if enabled is not None:
        _CHECK = bool(enabled)
    return _CHECK


def emulate(ops: Sequence[str] | None) -> None:
    """Send ``ops`` (avg, band, bor, bxor) down the emulated route on every backend; None restores
    the defaults. For measuring the emulation's cost on a backend that has the op natively, and
    for testing the route NCCL takes on a CPU-only machine. Every rank must make the same choice."""
    for kind, routes in _NATIVE_ROUTES.items():
        _ROUTES[kind] = dict(routes)
    for op in ops or ():
        name = _op_name(op)
        if name not in ("avg", *_BITWISE):
            raise ConfigError(f"op {name} has no emulated route; only avg, band, bor and bxor do")
        for routes in _ROUTES.values():
            routes[name] = "avg" if name == "avg" else "bitwise"


def forget_groups() -> None:
    """Drop cached group facts (after a group is destroyed)."""
    _GROUPS.clear()


def _op_name(op: Any) -> str:
    name = _OP_ALIASES.get(op)
    if name is None:
        inner = getattr(op, "op", None)  # a ReduceOp instance wrapping a RedOpType
        name = _OP_ALIASES.get(inner) if inner is not None else None
        if name is None:
            raise ConfigError(f"unknown reduction op {op!r}: use one of {' '.join(OP_NAMES)}")
    return name


def _group_info(group: Any, tensor: torch.Tensor | None) -> tuple[str, int, int]:
    """(backend kind, world size, rank) of the group for this tensor's device, cached per group."""
    pg = group if group is not None else c10d.GroupMember.WORLD
    is_cuda = tensor.is_cuda if tensor is not None else False
    info = _GROUPS.get((pg, is_cuda))
    if info is None:
        if pg is None:
            raise NoProcessGroup("no process group: run collectives inside `with dist.process_group():`, "
                                 "in a rank started by dist.launch, or in a %%distributed cell")
        backend = str(tdist.get_backend(pg)).lower()
        if "," in backend:  # e.g. "cpu:gloo,cuda:nccl": pick the one serving this tensor's device
            parts = dict(p.split(":", 1) for p in backend.split(","))
            backend = parts.get("cuda" if is_cuda else "cpu", backend)
        kind = backend if backend in ("gloo", "nccl") else "other"
        info = (kind, tdist.get_world_size(pg), tdist.get_rank())
        _GROUPS[(pg, is_cuda)] = info
    return info


def _route(op: Any, kind: str) -> tuple[str, str]:
    name = _op_name(op)
    return name, _ROUTES[kind][name]


# ---------------------------------------------------------------------------------------------
# Work handles


class Work:
    """Handle of an ``async_op=True`` collective. ``wait()`` also finishes an emulated op's local
    step, so the tensor holds the result once it returns."""

    __slots__ = ("_work", "_finish", "_done", "_name")

    def __init__(self, work: Any, name: str, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish
        self._done = False
        self._name = name

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (at most ``timeout`` seconds; then :class:`CollectiveTimeout`)."""
        if self._done:
            return True
        if self._work is not None:
            try:
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(datetime.timedelta(seconds=float(timeout)))
            except RuntimeError as exc:
                raise _explain(self._name, exc, waited=timeout) from exc
        if self._finish is not None:
            self._finish()
        self._done = True
        return True

    def is_completed(self) -> bool:
        """True once the communication is done (call ``wait()`` to finish an emulated op)."""
        return self._done or self._work is None or bool(self._work.is_completed())

    @property
    def torch_work(self) -> Any:
        """The underlying ``torch.distributed`` work object (None for purely local steps)."""
        return self._work

    def __repr__(self) -> str:
        return f"<clorch Work {self._name} {'done' if self._done else 'pending'}>"


def _finish(work: Any, name: str, async_op: bool, finish: Callable[[], None] | None) -> Work | None:
    if async_op:
        return Work(work, name, finish)
    if finish is not None:
        finish()
    return None


# ---------------------------------------------------------------------------------------------
# Errors


_PEER_GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "was aborted",
              "communicator was aborted", "remote process exited", "nccl communicator")
_TIMED_OUT = ("timed out", "timeout", "wait timeout")
_SHAPE = ("size", "shape", "split", "type", "dtype", "mismatch", "check failed", "expected")


def _explain(name: str, exc: BaseException, waited: float | None = None) -> CollectiveError:
    """Turn torch's message into one that says what probably happened and what to do."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    low = text.lower()
    try:
        where = f" on rank {tdist.get_rank()}"
    except Exception:
        where = ""
    if any(k in low for k in _PEER_GONE):
        return CollectiveError(f"{name}{where} failed because another rank went away (crashed, raised or "
                               f"was stopped): look at the other ranks' logs for the cause. torch said: {first}")
    if any(k in low for k in _TIMED_OUT):
        limit = f" within {waited} s" if waited is not None else ""
        return CollectiveTimeout(f"{name}{where} did not finish{limit}: a rank did not join it (it skipped or "
                                 "reordered a collective, or is still busy). Set CLORCH_DIST_CHECK=1 to compare "
                                 f"every call across ranks. torch said: {first}")
    if any(k in low for k in _SHAPE):
        return CollectiveMismatch(f"{name}{where}: the tensors' shapes, dtypes or split sizes do not fit this "
                                  f"collective. torch said: {first}")
    return CollectiveError(f"{name}{where} failed: {first}")


def _mismatch(name: str, what: str) -> CollectiveMismatch:
    return CollectiveMismatch(f"{name}: {what}; nothing was sent")


# ---------------------------------------------------------------------------------------------
# Emulations


def _avg_finish(tensor: torch.Tensor, n: int) -> Callable[[], None]:
    if tensor.is_floating_point() or tensor.is_complex():
        return lambda: tensor.div_(n)
    return lambda: tensor.div_(n, rounding_mode="trunc")


def _check_avg_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.bool:
        raise ConfigError(f"{name}: op avg needs a numeric tensor, not bool; use bor/band or convert first")


def _check_bitwise_dtype(name: str, op: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        raise ConfigError(f"{name}: op {op} needs an integer or bool tensor; got {tensor.dtype}")


def _gather_fold(tensor: torch.Tensor, op: str, world: int, group: Any, name: str, async_op: bool) -> Work | None:
    """Bitwise all-reduce on backends without it: gather every rank's copy, fold locally."""
    src = tensor.reshape(-1)
    flat = torch.empty(world * src.numel(), dtype=tensor.dtype, device=tensor.device)
    fold = _BITWISE[op]

    def finish() -> None:
        buf = flat.view(world, -1)
        acc = buf[0]
        for i in range(1, world):
            acc = fold(acc, buf[i])
        tensor.copy_(acc.view(tensor.shape))

    try:
        work = _all_gather_single(flat, src, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _explain(name, exc) from exc
    return _finish(work, name, async_op, finish)


# ---------------------------------------------------------------------------------------------
# Collectives


def all_reduce(tensor: torch.Tensor, op: Any = "sum", *, async_op: bool = False, group: Any = None) -> Work | None:
    """Reduce ``tensor`` across ranks, in place, with the same result on every backend."""
    kind, world, _ = _group_info(group, tensor)
    name, route = _route(op, kind)
    if _CHECK:
        _check_call(group, "all_reduce", tensor, op=name)
    if route == "native":
        if name == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            route = "avg"  # integer avg: the same truncating division on every backend
        else:
            if name in _BITWISE:
                _check_bitwise_dtype("all_reduce", name, tensor)
            try:
                work = tdist.all_reduce(tensor, op=_NATIVE[name], group=group, async_op=async_op)
            except RuntimeError as exc:
                raise _explain("all_reduce", exc) from exc
            return Work(work, "all_reduce") if async_op else None
    if route == "avg":
        _check_avg_dtype("all_reduce", tensor)
        try:
            work = tdist.all_reduce(tensor, op=ReduceOp.SUM, group=group, async_op=async_op)
        except RuntimeError as exc:
            raise _explain("all_reduce", exc) from exc
        return _finish(work, "all_reduce", async_op, _avg_finish(tensor, world))
    _check_bitwise_dtype("all_reduce", name, tensor)
    return _gather_fold(tensor, name, world, group, "all_reduce", async_op)


def reduce(tensor: torch.Tensor, op: Any = "sum", root: int = 0, *, async_op: bool = False,
           group: Any = None) -> Work | None:
    """Reduce onto ``root`` (a global rank), in place there; other ranks' tensors are scratch
    (with an emulated bitwise op on NCCL they also receive the result)."""
    kind, world, me = _group_info(group, tensor)
    name, route = _route(op, kind)
    if _CHECK:
        _check_call(group, "reduce", tensor, op=name, root=root)
    if route == "native" and name == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        route = "avg"
    if route == "native":
        if name in _BITWISE:
            _check_bitwise_dtype("reduce", name, tensor)
        try:
            work = tdist.reduce(tensor, root, op=_NATIVE[name], group=group, async_op=async_op)
        except RuntimeError as exc:
            raise _explain("reduce", exc) from exc
        return Work(work, "reduce") if async_op else None
    if route == "avg":
        _check_avg_dtype("reduce", tensor)
        try:
            work = tdist.reduce(tensor, root, op=ReduceOp.SUM, group=group, async_op=async_op)
        except RuntimeError as exc:
            raise _explain("reduce", exc) from exc
        finish = _avg_finish(tensor, world) if me == root else None
        return _finish(work, "reduce", async_op, finish)
    _check_bitwise_dtype("reduce", name, tensor)
    return _gather_fold(tensor, name, world, group, "reduce", async_op)


def broadcast(tensor: torch.Tensor, root: int = 0, *, async_op: bool = False, group: Any = None) -> Work | None:
    """Copy ``root``'s tensor (``root`` is a global rank) into every rank's tensor, in place."""
    if _CHECK:
        _check_call(group, "broadcast", tensor, root=root)
    try:
        work = tdist.broadcast(tensor, root, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _explain("broadcast", exc) from exc
    return Work(work, "broadcast") if async_op else None


def all_gather_into(output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                    group: Any = None) -> Work | None:
    """Gather every rank's ``input`` into ``output`` (world_size x input: concatenated along dim 0
    or stacked), rank order."""
    _, world, _ = _group_info(group, input)
    if _CHECK:  # first: a rank whose local check fails must not leave the others in this exchange
        _check_call(group, "all_gather_into", input, extra=f"out={_shape(output)}")
    if output.numel() != world * input.numel():
        raise _mismatch("all_gather_into", f"output has {output.numel()} elements but needs world_size "
                        f"({world}) x input ({input.numel()}) = {world * input.numel()}")
    if output.dtype != input.dtype:
        raise _mismatch("all_gather_into", f"output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.dim() != input.dim() and output.is_contiguous():
        # The stacked form (world, *input.shape): same memory as the concatenated one, which is
        # the only form every backend accepts (gloo refuses the stacked one).
        output, input = output.view(-1), input.reshape(-1)
    try:
        work = _all_gather_single(output, input, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _explain("all_gather_into", exc) from exc
    return Work(work, "all_gather_into") if async_op else None


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, op: Any = "sum", *, async_op: bool = False,
                        group: Any = None) -> Work | None:
    """Reduce ``input`` (world_size x output) across ranks; rank r keeps the r-th chunk in ``output``."""
    kind, world, _ = _group_info(group, input)
    name, route = _route(op, kind)
    if _CHECK:  # first, as in all_gather_into
        _check_call(group, "reduce_scatter_into", input, op=name, extra=f"out={_shape(output)}")
    if input.numel() != world * output.numel():
        raise _mismatch("reduce_scatter_into", f"input has {input.numel()} elements but needs world_size "
                        f"({world}) x output ({output.numel()}) = {world * output.numel()}")
    if output.dtype != input.dtype:
        raise _mismatch("reduce_scatter_into", f"output dtype {output.dtype} differs from input dtype {input.dtype}")
    if route == "native" and name == "avg" and not (input.is_floating_point() or input.is_complex()):
        route = "avg"
    if route == "bitwise":
        _check_bitwise_dtype("reduce_scatter_into", name, input)
        # All-to-all: rank r receives chunk r of every rank's input, then folds them locally.
        buf = torch.empty((world, output.numel()), dtype=input.dtype, device=input.device)
        fold = _BITWISE[name]

        def fold_chunks() -> None:
            acc = buf[0]
            for i in range(1, world):
                acc = fold(acc, buf[i])
            output.copy_(acc.view(output.shape))

        try:
            work = tdist.all_to_all_single(buf, input.contiguous().view(world, -1), group=group, async_op=async_op)
        except RuntimeError as exc:
            raise _explain("reduce_scatter_into", exc) from exc
        return _finish(work, "reduce_scatter_into", async_op, fold_chunks)
    if name in _BITWISE:
        _check_bitwise_dtype("reduce_scatter_into", name, input)
    if route == "avg":
        _check_avg_dtype("reduce_scatter_into", input)
    native = ReduceOp.SUM if route == "avg" else _NATIVE[name]
    if input.dim() != output.dim() and input.is_contiguous() and output.is_contiguous():
        input, output = input.view(-1), output.view(-1)  # stacked form -> concatenated, as for all_gather
    try:
        work = _reduce_scatter_single(output, input, op=native, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _explain("reduce_scatter_into", exc) from exc
    return _finish(work, "reduce_scatter_into", async_op, _avg_finish(output, world) if route == "avg" else None)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False,
                      group: Any = None) -> Work | None:
    """Rank r sends its i-th slice of ``input`` (rows along dim 0) to rank i and receives rank i's
    r-th slice into ``output``; split sizes count rows (None: equal slices)."""
    _, world, _ = _group_info(group, input)
    if _CHECK:  # first, as in all_gather_into
        _check_call(group, "all_to_all_single", input, splits=(input_split_sizes, output_split_sizes, output))
    for label, splits, tensor in (("input", input_split_sizes, input), ("output", output_split_sizes, output)):
        if splits is not None:
            if len(splits) != world:
                raise _mismatch("all_to_all_single", f"{label}_split_sizes has {len(splits)} entries but there "
                                f"are {world} ranks; give one size per rank")
            rows = tensor.shape[0] if tensor.dim() else 1
            if sum(splits) != rows:
                raise _mismatch("all_to_all_single", f"{label}_split_sizes {list(splits)} add up to {sum(splits)} "
                                f"but {label} has {rows} rows along dim 0")
        elif tensor.dim() and tensor.shape[0] % world:
            raise _mismatch("all_to_all_single", f"{label} has {tensor.shape[0]} rows, which do not split evenly "
                            f"over {world} ranks; pass {label}_split_sizes")
    if output.dtype != input.dtype:
        raise _mismatch("all_to_all_single", f"output dtype {output.dtype} differs from input dtype {input.dtype}")
    try:
        work = tdist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                       async_op=async_op)
    except RuntimeError as exc:
        raise _explain("all_to_all_single", exc) from exc
    return Work(work, "all_to_all_single") if async_op else None


def send(tensor: torch.Tensor, dst: int, *, async_op: bool = False, group: Any = None, tag: int = 0) -> Work | None:
    """Send ``tensor`` to rank ``dst`` (a global rank); ``async_op=True`` returns at once."""
    if _CHECK:
        _check_p2p(group, "send", tensor, dst)
    try:
        if async_op:
            return Work(tdist.isend(tensor, dst, group=group, tag=tag), "send")
        tdist.send(tensor, dst, group=group, tag=tag)
    except RuntimeError as exc:
        raise _explain("send", exc) from exc
    return None


def recv(tensor: torch.Tensor, src: int | None = None, *, async_op: bool = False, group: Any = None,
         tag: int = 0) -> int | Work:
    """Receive into ``tensor`` from rank ``src`` (None: any rank, gloo only); returns the sender's
    rank, or a work handle with ``async_op=True``."""
    if _CHECK and src is not None:
        _check_p2p(group, "recv", tensor, src)
    try:
        if async_op:
            return Work(tdist.irecv(tensor, src, group=group, tag=tag), "recv")
        return tdist.recv(tensor, src, group=group, tag=tag)
    except RuntimeError as exc:
        raise _explain("recv", exc) from exc


def barrier(*, async_op: bool = False, group: Any = None) -> Work | None:
    """Wait until every rank reaches the barrier (``async_op=True``: a handle to wait on later)."""
    if _CHECK:
        _check_call(group, "barrier", None)
    try:
        work = tdist.barrier(group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _explain("barrier", exc) from exc
    return Work(work, "barrier") if async_op else None


# ---------------------------------------------------------------------------------------------
# Check mode hooks (the work is in check.py, imported only when check mode is used)


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _check_call(group: Any, name: str, tensor: torch.Tensor | None, **details: Any) -> None:
    from . import check

    check.verify_collective(group, name, tensor, **details)


def _check_p2p(group: Any, name: str, tensor: torch.Tensor, peer: int) -> None:
    from . import check

    check.verify_p2p(group, name, tensor, peer)
