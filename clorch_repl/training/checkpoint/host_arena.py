"""Host memory that an asynchronous save's staged state lives in, shared with the rank's writer
process (:mod:`.writer_process`) and pinned for the GPU's copies.

Why shared: the background write of a checkpoint is mostly Python (DCP's per-item ``torch.save``,
pickling, CRCs) and, on a thread of the rank, it takes the GIL from the training steps that run
meanwhile. Measured on one H200 (504M parameters, 2,883 MiB of state): the 20 steps run during
the write lost 1.1-1.6 s together, 0.32-0.38 of a blocking save, while the call itself took
0.1 s. A writer *process* has a GIL of its own, but it must see the staged tensors without a
copy: so they are carved out of one anonymous shared-memory file (``memfd``), mapped here and
there, which no other process can open (it has no name; its descriptor goes to the writer over
their private socket).

Why pinned: the GPU copies into it with non-blocking copies at the link's bandwidth, as into
``pin_memory=True`` buffers (``cudaHostRegister``, as torch's own shared-memory stager does).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import weakref

import torch

logger = logging.getLogger(__name__)

__all__ = ["HostArena"]

#: every tensor starts at a multiple of this (a cache line; more than any dtype needs)
ALIGN = 64


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _unpin(address: int) -> None:
    result = int(torch.cuda.cudart().cudaHostUnregister(address))
    if result != 0:
        logger.warning("unpinning a checkpoint's staging memory failed (cudaError %d)", result)


class HostArena:
    """One shared, optionally pinned block of host memory, handed out as tensors in order.

    ``fd`` is the block's descriptor (to send to the writer process); :meth:`locate` tells where
    a tensor handed out lies in it. The block lives as long as this object or any of its tensors.
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = max(ALIGN, nbytes)
        self.fd = os.memfd_create("clorch-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._next = 0
        self.pinned = False
        if pin:
            result = int(torch.cuda.cudart().cudaHostRegister(self._base, self.nbytes, 1))  # 1: portable
            self.pinned = result == 0
            if not self.pinned:  # slower copies, not wrong ones: say so once, go on
                logger.warning("pinning %d MiB of checkpoint staging memory failed (cudaError %d): the copies "
                               "to host memory will be synchronous", self.nbytes >> 20, result)
        weakref.finalize(self, _close, self.fd, self._base if self.pinned else None)

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        """The bytes an arena needs to hold copies of ``tensors`` (alignment included)."""
        total = 0
        for tensor in tensors:
            total = _aligned(total) + tensor.numel() * tensor.element_size()
        return total

    def tensor(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free part of the block, as a contiguous tensor of ``shape`` and ``dtype``."""
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        offset = _aligned(self._next)
        size = numel * dtype.itemsize
        if offset + size > self.nbytes:
            raise ValueError(f"the staging arena of {self.nbytes} bytes has no room for {size} more at {offset}")
        self._next = offset + size
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset).view(shape)

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The offset of ``tensor``'s elements in the block, or None if they are not a contiguous
        run inside it (the writer then gets the tensor's bytes instead)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
            return None
        start = tensor.data_ptr() - self._base
        if 0 <= start and start + tensor.numel() * tensor.element_size() <= self.nbytes:
            return start
        return None


def _close(fd: int, pinned_base: int | None) -> None:
    if pinned_base is not None:
        _unpin(pinned_base)
    os.close(fd)
