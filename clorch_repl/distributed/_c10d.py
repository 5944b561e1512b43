"""What clorch_repl asks of torch.distributed (its c10d layer), in one leaf module.

* the names of the tensor-in/tensor-out collectives in the running torch release;
* cached facts about a group: backend kind, size and this process's rank;
* this process's rank and world size in the default group (0 and 1 without one).

:mod:`.collectives`, :mod:`.check`, :mod:`.group` and :mod:`clorch_repl.training` read them here,
so none of them imports another for these facts (check mode and the collectives used to import
each other for them). It imports nothing of the package but its errors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

from ..errors import NoProcessGroup

__all__ = ["all_gather_single", "reduce_scatter_single", "group_info", "forget_groups", "shape_text", "active",
           "rank", "world_size"]

# torch 2.13 renamed the tensor-in/tensor-out collectives and deprecated the old names; older
# releases only have the old names (and before those, the private *_base ones).
all_gather_single = (getattr(tdist, "all_gather_single", None) or getattr(tdist, "all_gather_into_tensor", None)
                     or getattr(tdist, "_all_gather_base"))
reduce_scatter_single = (getattr(tdist, "reduce_scatter_single", None)
                         or getattr(tdist, "reduce_scatter_tensor", None) or getattr(tdist, "_reduce_scatter_base"))

_GROUPS: dict[tuple[Any, bool], tuple[str, int, int]] = {}


def group_info(group: Any, tensor: torch.Tensor | None) -> tuple[str, int, int]:
    """(backend kind, world size, rank) of the group for this tensor's device, cached per group.

    The kind is ``gloo``, ``nccl`` or ``other``; a group with one backend per device type (e.g.
    ``cpu:gloo,cuda:nccl``) answers with the one that serves the tensor's device.
    """
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


def forget_groups() -> None:
    """Drop cached group facts (after a group is destroyed)."""
    _GROUPS.clear()


def shape_text(t: torch.Tensor) -> str:
    """``float32[4, 2]``: a tensor's dtype and shape as error messages show them."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def active() -> bool:
    """Whether this process is in an initialised default group."""
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    """This process's rank in the default group; 0 without one (a single process)."""
    return tdist.get_rank() if active() else 0


def world_size() -> int:
    """Ranks in the default group; 1 without one (a single process)."""
    return tdist.get_world_size() if active() else 1
