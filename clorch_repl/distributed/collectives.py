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
from types import TracebackType
from typing import Any, Callable, Sequence

import torch
import torch.distributed as tdist

from ..common import env_vars
from ..errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, ConfigError
from . import check
from ._c10d import all_gather_single as _all_gather_single
from ._c10d import group_info, shape_text
from ._c10d import reduce_scatter_single as _reduce_scatter_single
from .failures import MISMATCH, peer_gone, timed_out

ReduceOp = tdist.ReduceOp

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

_CHECK = (env_vars.DIST_CHECK.get() or "").strip().lower() in ("1", "true", "yes", "on")


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


def _op_name(op: Any) -> str:
    name = _OP_ALIASES.get(op)
    if name is None:
        inner = getattr(op, "op", None)  # a ReduceOp instance wrapping a RedOpType
        name = _OP_ALIASES.get(inner) if inner is not None else None
        if name is None:
            raise ConfigError(f"unknown reduction op {op!r}: use one of {' '.join(OP_NAMES)}")
    return name


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
            with _explained(self._name, waited=timeout):
                if timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(datetime.timedelta(seconds=float(timeout)))
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


def _explain(name: str, exc: BaseException, waited: float | None = None) -> CollectiveError:
    """Turn torch's message into one that says what probably happened and what to do."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    low = text.lower()
    try:
        where = f" on rank {tdist.get_rank()}" if tdist.is_initialized() else ""
    except (RuntimeError, ValueError):  # the group is being torn down: the message goes without it
        where = ""
    if peer_gone(text):
        return CollectiveError(f"{name}{where} failed because another rank went away (crashed, raised or "
                               f"was stopped): look at the other ranks' logs for the cause. torch said: {first}")
    if timed_out(text):
        limit = f" within {waited} s" if waited is not None else ""
        return CollectiveTimeout(f"{name}{where} did not finish{limit}: a rank did not join it (it skipped or "
                                 "reordered a collective, or is still busy). Set CLORCH_DIST_CHECK=1 to compare "
                                 f"every call across ranks. torch said: {first}")
    if any(k in low for k in MISMATCH):
        return CollectiveMismatch(f"{name}{where}: the tensors' shapes, dtypes or split sizes do not fit this "
                                  f"collective. torch said: {first}")
    return CollectiveError(f"{name}{where} failed: {first}")


class _explained:  # noqa: N801 - used like a function: ``with _explained("all_reduce"):``
    """Around a torch.distributed call: its RuntimeError leaves as the CollectiveError that
    :func:`_explain` makes of it (torch's own error is kept as the cause). A class rather than a
    generator-based context manager: it sits on every collective's path, and costs less."""

    __slots__ = ("_name", "_waited")

    def __init__(self, name: str, waited: float | None = None) -> None:
        self._name = name
        self._waited = waited

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None and isinstance(exc, RuntimeError):
            raise _explain(self._name, exc, self._waited) from exc


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

    with _explained(name):
        work = _all_gather_single(flat, src, group=group, async_op=async_op)
    return _finish(work, name, async_op, finish)


# ---------------------------------------------------------------------------------------------
# Collectives


def all_reduce(tensor: torch.Tensor, op: Any = "sum", *, async_op: bool = False, group: Any = None) -> Work | None:
    """Reduce ``tensor`` across ranks, in place, with the same result on every backend."""
    kind, world, _ = group_info(group, tensor)
    name, route = _route(op, kind)
    if _CHECK:
        check.verify_collective(group, "all_reduce", tensor, op=name)
    if route == "native":
        if name == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            route = "avg"  # integer avg: the same truncating division on every backend
        else:
            if name in _BITWISE:
                _check_bitwise_dtype("all_reduce", name, tensor)
            with _explained("all_reduce"):
                work = tdist.all_reduce(tensor, op=_NATIVE[name], group=group, async_op=async_op)
            return Work(work, "all_reduce") if async_op else None
    if route == "avg":
        _check_avg_dtype("all_reduce", tensor)
        with _explained("all_reduce"):
            work = tdist.all_reduce(tensor, op=ReduceOp.SUM, group=group, async_op=async_op)
        return _finish(work, "all_reduce", async_op, _avg_finish(tensor, world))
    _check_bitwise_dtype("all_reduce", name, tensor)
    return _gather_fold(tensor, name, world, group, "all_reduce", async_op)


def reduce(tensor: torch.Tensor, op: Any = "sum", root: int = 0, *, async_op: bool = False,
           group: Any = None) -> Work | None:
    """Reduce onto ``root`` (a global rank), in place there; other ranks' tensors are scratch
    (with an emulated bitwise op on NCCL they also receive the result)."""
    kind, world, me = group_info(group, tensor)
    name, route = _route(op, kind)
    if _CHECK:
        check.verify_collective(group, "reduce", tensor, op=name, root=root)
    if route == "native" and name == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        route = "avg"
    if route == "native":
        if name in _BITWISE:
            _check_bitwise_dtype("reduce", name, tensor)
        with _explained("reduce"):
            work = tdist.reduce(tensor, root, op=_NATIVE[name], group=group, async_op=async_op)
        return Work(work, "reduce") if async_op else None
    if route == "avg":
        _check_avg_dtype("reduce", tensor)
        with _explained("reduce"):
            work = tdist.reduce(tensor, root, op=ReduceOp.SUM, group=group, async_op=async_op)
        finish = _avg_finish(tensor, world) if me == root else None
        return _finish(work, "reduce", async_op, finish)
    _check_bitwise_dtype("reduce", name, tensor)
    return _gather_fold(tensor, name, world, group, "reduce", async_op)


def broadcast(tensor: torch.Tensor, root: int = 0, *, async_op: bool = False, group: Any = None) -> Work | None:
    """Copy ``root``'s tensor (``root`` is a global rank) into every rank's tensor, in place."""
    if _CHECK:
        check.verify_collective(group, "broadcast", tensor, root=root)
    with _explained("broadcast"):
        work = tdist.broadcast(tensor, root, group=group, async_op=async_op)
    return Work(work, "broadcast") if async_op else None


def all_gather_into(output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                    group: Any = None) -> Work | None:
    """Gather every rank's ``input`` into ``output`` (world_size x input: concatenated along dim 0
    or stacked), rank order."""
    _, world, _ = group_info(group, input)
    if _CHECK:  # first: a rank whose local check fails must not leave the others in this exchange
        check.verify_collective(group, "all_gather_into", input, extra=f"out={shape_text(output)}")
    if output.numel() != world * input.numel():
        raise _mismatch("all_gather_into", f"output has {output.numel()} elements but needs world_size "
                        f"({world}) x input ({input.numel()}) = {world * input.numel()}")
    if output.dtype != input.dtype:
        raise _mismatch("all_gather_into", f"output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.dim() != input.dim() and output.is_contiguous():
        # The stacked form (world, *input.shape): same memory as the concatenated one, which is
        # the only form every backend accepts (gloo refuses the stacked one).
        output, input = output.view(-1), input.reshape(-1)
    with _explained("all_gather_into"):
        work = _all_gather_single(output, input, group=group, async_op=async_op)
    return Work(work, "all_gather_into") if async_op else None


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, op: Any = "sum", *, async_op: bool = False,
                        group: Any = None) -> Work | None:
    """Reduce ``input`` (world_size x output) across ranks; rank r keeps the r-th chunk in ``output``."""
    kind, world, _ = group_info(group, input)
    name, route = _route(op, kind)
    if _CHECK:  # first, as in all_gather_into
        check.verify_collective(group, "reduce_scatter_into", input, op=name, extra=f"out={shape_text(output)}")
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

        with _explained("reduce_scatter_into"):
            work = tdist.all_to_all_single(buf, input.contiguous().view(world, -1), group=group, async_op=async_op)
        return _finish(work, "reduce_scatter_into", async_op, fold_chunks)
    if name in _BITWISE:
        _check_bitwise_dtype("reduce_scatter_into", name, input)
    if route == "avg":
        _check_avg_dtype("reduce_scatter_into", input)
    native = ReduceOp.SUM if route == "avg" else _NATIVE[name]
    if input.dim() != output.dim() and input.is_contiguous() and output.is_contiguous():
        input, output = input.view(-1), output.view(-1)  # stacked form -> concatenated, as for all_gather
    with _explained("reduce_scatter_into"):
        work = _reduce_scatter_single(output, input, op=native, group=group, async_op=async_op)
    return _finish(work, "reduce_scatter_into", async_op, _avg_finish(output, world) if route == "avg" else None)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False,
                      group: Any = None) -> Work | None:
    """Rank r sends its i-th slice of ``input`` (rows along dim 0) to rank i and receives rank i's
    r-th slice into ``output``; split sizes count rows (None: equal slices)."""
    _, world, _ = group_info(group, input)
    if _CHECK:  # first, as in all_gather_into
        check.verify_collective(group, "all_to_all_single", input, splits=(input_split_sizes, output_split_sizes, output))
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
    with _explained("all_to_all_single"):
        work = tdist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                       async_op=async_op)
    return Work(work, "all_to_all_single") if async_op else None


def send(tensor: torch.Tensor, dst: int, *, async_op: bool = False, group: Any = None, tag: int = 0) -> Work | None:
    """Send ``tensor`` to rank ``dst`` (a global rank); ``async_op=True`` returns at once."""
    if _CHECK:
        check.verify_p2p(group, "send", tensor, dst)
    with _explained("send"):
        if async_op:
            return Work(tdist.isend(tensor, dst, group=group, tag=tag), "send")
        tdist.send(tensor, dst, group=group, tag=tag)
    return None


def recv(tensor: torch.Tensor, src: int | None = None, *, async_op: bool = False, group: Any = None,
         tag: int = 0) -> int | Work:
    """Receive into ``tensor`` from rank ``src`` (None: any rank, gloo only); returns the sender's
    rank, or a work handle with ``async_op=True``."""
    if _CHECK and src is not None:
        check.verify_p2p(group, "recv", tensor, src)
    with _explained("recv"):
        if async_op:
            return Work(tdist.irecv(tensor, src, group=group, tag=tag), "recv")
        return tdist.recv(tensor, src, group=group, tag=tag)


def barrier(*, async_op: bool = False, group: Any = None) -> Work | None:
    """Wait until every rank reaches the barrier (``async_op=True``: a handle to wait on later)."""
    if _CHECK:
        check.verify_collective(group, "barrier", None)
    with _explained("barrier"):
        work = tdist.barrier(group=group, async_op=async_op)
    return Work(work, "barrier") if async_op else None
