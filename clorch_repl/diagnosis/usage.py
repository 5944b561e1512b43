"""What a rank uses right now, asked by ``%clorch top`` through the rank's probe: its CPU and
memory, and its GPU's utilisation and memory read from NVML on the rank's own host.

Read on the rank (its control thread), so the figures are right wherever the rank runs: a pid's
RSS read on the notebook's host would be another process's on another host. NVML is called
through ctypes (as :mod:`clorch_repl.cuda` counts GPUs), so a probe never creates a CUDA context
or imports pynvml; a host without NVML answers ``None`` for the GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import psutil

logger = logging.getLogger(__name__)

__all__ = ["usage"]

_lock = threading.Lock()
_process: psutil.Process | None = None
_nvml: Any = None
_nvml_failed = False


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _library() -> Any:
    global _nvml, _nvml_failed
    if _nvml is None and not _nvml_failed:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
            _nvml = lib
        except (OSError, AttributeError) as exc:
            logger.debug("no NVML here: %s", exc)
            _nvml_failed = True
    return _nvml


def _handle(lib: Any) -> Any:
    """This rank's GPU as its host names it (an index or a UUID; NVML numbers GPUs as the host
    does, whatever CUDA_VISIBLE_DEVICES lists): the launcher's GPU_INDEX_ENV, else the entry of
    CUDA_VISIBLE_DEVICES that is the rank's (LOCAL_RANK's under torchrun's convention), else GPU 0."""
    from ..wire.rank_env import GPU_INDEX_ENV, device_index

    listed = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if v.strip()] or ["0"]
    visible = os.environ.get(GPU_INDEX_ENV, "").strip() or listed[min(device_index(os.environ) or 0, len(listed) - 1)]
    handle = ctypes.c_void_p()
    if visible.isdigit():
        code = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(visible)), ctypes.byref(handle))
    else:
        code = lib.nvmlDeviceGetHandleByUUID(visible.encode(), ctypes.byref(handle))
    return handle if code == 0 else None


def _gpu() -> dict[str, Any] | None:
    lib = _library()
    if lib is None or os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return None
    handle = _handle(lib)
    if handle is None:
        return None
    util, mem = _Utilization(), _Memory()
    if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) != 0:
        return None
    if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
        return None
    return {"util_pct": int(util.gpu), "memory_used": int(mem.used), "memory_total": int(mem.total)}


def usage() -> dict[str, Any]:
    """CPU percent since the last call, resident bytes, and the GPU's figures (or None)."""
    global _process
    with _lock:
        if _process is None:
            _process = psutil.Process()
            _process.cpu_percent(None)  # the first call only starts the interval
        try:
            cpu, rss = _process.cpu_percent(None), _process.memory_info().rss
        except psutil.Error:
            cpu, rss = None, None
        return {"cpu_pct": cpu, "rss": rss, "gpu": _gpu()}
