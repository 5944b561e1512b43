"""Copying a checkpoint's state to host memory, so an asynchronous save can write it while
training changes the weights.

The copy is the only part of an asynchronous save that training waits for: once it is done the
optimizer may step again. Two things keep it short. The host buffers are kept between saves (a
second save of the same state reuses them: allocating pinned memory costs about as much as
filling it), and GPU tensors go to pinned memory with non-blocking copies, all queued before one
synchronisation, so the copies run at the link's bandwidth. The buffers are one shared block
(:class:`.host_arena.HostArena`), which the rank's writer process reads without a copy.

A DTensor (FSDP2, tensor parallel) is staged as a DTensor of the same mesh and placements whose
local shard is the host buffer: what DCP writes of it is the shard, and where it belongs. That is
how torch's own stager stages them (``torch.distributed._state_dict_utils``); it is done here so
the buffers are reused and never alias the live tensors.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from .host_arena import HostArena

logger = logging.getLogger(__name__)

__all__ = ["Stager"]


def _layout(obj: Any) -> Any:
    """What must be equal for the buffers of one staging to serve another."""
    if isinstance(obj, DTensor):
        local = obj.to_local()
        return ("D", tuple(obj.shape), obj.dtype, tuple(local.shape), str(obj.placements), id(obj.device_mesh))
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return ("d", tuple((k, _layout(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_layout(v) for v in obj))
    return ("v",)


def _local_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors a staging of ``obj`` copies (a DTensor's local shard), in :meth:`Stager._allocate`'s order."""
    if isinstance(obj, DTensor):
        return [obj.to_local()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _local_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _local_tensors(v)]
    return []


def _plan_once(staged: DTensor) -> None:
    """Make DCP plan ``staged``'s write once for the buffers' life, not at every save.

    Why: an asynchronous save plans on the rank's save thread, with the GIL the training steps
    need, and DCP builds every DTensor's write item afresh at each save (its plan cache compares
    plans only once they are built): the shard's offsets from the mesh (``compute_local_shape_and_
    global_offset``) and its properties. On one H200, 1,440 DTensors of a 504M-parameter FSDP2
    model and AdamW, that part took about 0.3 s of the 0.69 s of CPU the save's thread spent while
    the steps ran (docs/PERFORMANCE.md, issue 39). A staged DTensor is the same object, with the
    same mesh, placements and host buffer, at every save of the same layout (a new layout makes
    new ones), so its write item is too.

    How: DCP asks a DTensor for its write items, and a DTensor asks its local tensor first when
    that has ``__create_write_items__`` (torch's hook for local shard types); the staged local
    tensor (a host buffer of ours) gets one that builds the item once per name and returns it
    again. DCP's write items are frozen dataclasses and it only reads them."""
    try:
        from torch.distributed.checkpoint.planner_helpers import _create_write_items_for_dtensor
    except ImportError:  # a torch that builds them elsewhere: DCP plans the DTensor itself, as before
        logger.debug("DCP's _create_write_items_for_dtensor is missing: staged DTensors are planned at each save")
        return
    items: dict[str, list[Any]] = {}
    # weakly: the buffer holds this function, and a strong reference to the DTensor that holds the
    # buffer would keep the staged memory (the shared block) alive past the Stager's dropping it,
    # until a full collection, while the next layout's block is made
    owner = weakref.ref(staged)

    def create_write_items(fqn: str, obj: Any) -> list[Any]:
        mine = obj is owner()
        found = items.get(fqn) if mine else None
        if found is None:
            found = [_create_write_items_for_dtensor(fqn, obj)]
            if mine:
                items[fqn] = found
        return list(found)

    staged._local_tensor.__create_write_items__ = create_write_items


class Stager:
    """Stages nested state dicts into host buffers kept for the next staging of the same layout.

    The buffers are carved from one :class:`HostArena` (shared with the writer process, pinned
    when any tensor is on a GPU); :attr:`arena` is the current one, None before the first staging.
    """

    def __init__(self, before_new_block: Callable[[], None] | None = None) -> None:
        self._layout: Any = None
        self._buffers: Any = None
        self.arena: HostArena | None = None
        #: called before a new block is made, so that whoever else maps the old one lets it go
        #: (the writer process): two blocks of a large state at once could exhaust host memory
        self._before_new_block = before_new_block

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """A copy of ``state`` in host memory, finished (GPU copies synchronised) on return."""
        layout = _layout(state)
        if layout != self._layout:
            self._buffers = self._layout = self.arena = None  # the old block goes before the new one is made
            if self._before_new_block is not None:
                self._before_new_block()
            tensors = _local_tensors(state)
            self.arena = HostArena(HostArena.size_of(tensors), pin=any(t.device.type == "cuda" for t in tensors))
            self._buffers = self._allocate(state)
            self._layout = layout
        staged = self._copy(state, self._buffers)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged

    def release(self) -> None:
        """Drop the kept buffers (the next staging allocates them again)."""
        self._layout = self._buffers = self.arena = None

    def _allocate(self, obj: Any) -> Any:
        if isinstance(obj, DTensor):
            staged = obj.to("cpu", copy=True)  # same spec, a new host local tensor (as torch's stager)
            local = obj.to_local()
            staged._local_tensor = self.arena.tensor(local.shape, local.dtype)
            _plan_once(staged)
            return staged
        if isinstance(obj, torch.Tensor):
            return self.arena.tensor(obj.shape, obj.dtype)
        if isinstance(obj, dict):
            return {k: self._allocate(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._allocate(v) for v in obj)
        return None

    def _copy(self, obj: Any, buffer: Any) -> Any:
        if isinstance(obj, DTensor):
            buffer.to_local().copy_(obj.to_local(), non_blocking=True)
            return buffer
        if isinstance(obj, torch.Tensor):
            buffer.copy_(obj.detach(), non_blocking=True)
            return buffer
        if isinstance(obj, dict):
            return {k: self._copy(v, buffer[k]) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, b) for v, b in zip(obj, buffer))
        return copy.deepcopy(obj)
