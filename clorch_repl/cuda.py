"""GPU discovery that never initialises CUDA in the calling process.

The notebook's own process must stay CUDA-free: a CUDA context there would pin memory on GPU 0,
and any later ``fork`` (DataLoader workers, multiprocessing) would inherit a broken context. So
the count comes from NVML (which reads the driver, not the runtime) and, where NVML is not
usable, from a short-lived child process.

Nor need it import torch: a CUDA build of torch takes seconds to import (4.5 s on the H200 box),
and ``%load_ext`` asks for the count to warm spares for the first start, which then waited as
long again for the spares' own imports. Which build is installed is read from its files
(``torch/lib/libtorch_cuda.so``), and NVML is called through ctypes, as torch itself does in
``torch.cuda._device_count_nvml``; torch is imported only where that cannot answer.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys

logger = logging.getLogger(__name__)

__all__ = ["available", "device_count"]


def _visible_limit() -> int | None:
    """How many devices CUDA_VISIBLE_DEVICES allows, or None when it is unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [v for v in value.split(",") if v.strip()]
    # CUDA stops at the first invalid entry (e.g. "-1"); count up to it.
    count = 0
    for entry in entries:
        entry = entry.strip()
        if entry.startswith("-"):
            break
        count += 1
    return count


def _torch_build() -> str:
    """"cuda", "rocm", "cpu", "" (no torch) or "unknown": from the imported module if it is,
    else from the installed files, without importing it."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        if getattr(torch.version, "hip", None):
            return "rocm"
        return "cuda" if torch.version.cuda else "cpu"
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return ""
    lib = os.path.join(next(iter(spec.submodule_search_locations)), "lib")
    try:
        names = os.listdir(lib)
    except OSError:
        return "unknown"  # an unusual layout: torch itself says (see _count_for)
    if any(n.startswith("libtorch_hip") for n in names):
        return "rocm"
    return "cuda" if any(n.startswith("libtorch_cuda") for n in names) else "cpu"


def _visible_count(physical: int) -> int | None:
    """How many of ``physical`` devices CUDA_VISIBLE_DEVICES lets a process use, read as CUDA
    reads it (torch's ``_parse_visible_devices`` rules): ordinals up to the first invalid or
    absent one, and none at all if one repeats. None for UUIDs and MIG names, which only NVML's
    device list (torch's own path, below) can resolve."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return physical
    seen: list[int] = []
    for entry in value.split(","):
        entry = entry.strip()
        if entry.startswith(("GPU-", "MIG-")):
            return None
        number = re.match(r"[+-]?\d+", entry)  # CUDA reads the leading number: "1abc" is 1
        if number is None:
            break
        ordinal = int(number.group())
        if ordinal < 0 or ordinal >= physical:
            break
        if ordinal in seen:
            return 0
        seen.append(ordinal)
    return len(seen)


def _nvml_count() -> int:
    """The driver's device count through NVML (libnvidia-ml, ctypes), or -1 when NVML cannot
    say. Creates no CUDA context."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return -1
    except (OSError, AttributeError):  # no driver library, or one too old to have nvmlInit_v2
        return -1
    try:
        count = ctypes.c_uint()
        return int(count.value) if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else -1
    finally:
        nvml.nvmlShutdown()


@functools.lru_cache(maxsize=None)
def _count_for(visible: str | None) -> int:
    build = _torch_build()
    if build in ("", "cpu"):
        return 0  # no torch, or a CPU build of it: no GPU can be used, whatever the machine has
    count = _nvml_count() if build == "cuda" else -1
    visible = _visible_count(count) if count >= 0 else None
    if visible is not None:
        return visible
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return 0  # a CPU build after all (its files did not say)
    count = -1
    nvml_count = getattr(torch.cuda, "_device_count_nvml", None)
    if nvml_count is not None:
        try:
            count = int(nvml_count())
        except Exception as exc:  # noqa: BLE001 - NVML's errors vary by driver; the probe below decides
            logger.debug("NVML device count failed (%s); asking a throwaway process", exc)
            count = -1
    if count < 0:
        # NVML unusable: ask a throwaway process, whose CUDA initialisation dies with it.
        probe = "import torch; print(torch.cuda.device_count())"
        try:
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                 timeout=120, check=True).stdout
            count = int(out.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            logger.warning("clorch_repl: could not count GPUs (%s); assuming none", exc)
            count = 0
    limit = _visible_limit()
    if limit is not None:
        count = min(count, limit)
    return max(count, 0)


def device_count() -> int:
    """Number of CUDA devices this process could use, without initialising CUDA here."""
    return _count_for(os.environ.get("CUDA_VISIBLE_DEVICES"))


def available() -> bool:
    """Whether at least one CUDA device can be used, without initialising CUDA here."""
    return device_count() > 0


def device_nodes() -> bool:
    """Whether this host has an NVIDIA GPU device node (/dev/nvidiaN): a cheap first look that
    imports nothing, for callers that would otherwise import torch only to learn there is no GPU."""
    try:
        return any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))
    except OSError:
        return False


def memory_by_pid() -> dict[int, int]:
    """GPU memory in bytes per process on this host, from nvidia-smi (so that the asking process
    never touches CUDA itself); empty without nvidia-smi or when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("nvidia-smi failed: %s", exc)
        return {}
    usage: dict[int, int] = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x.strip()) for x in line.split(","))
        except ValueError:  # a header or "[N/A]": not a process's figure
            continue
        usage[pid] = mib * 1024 * 1024
    return usage
