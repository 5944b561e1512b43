"""The CPU cores next to a GPU, and binding a rank to them (``%clorch start --cpu-bind numa``).

On a machine with several NUMA nodes, a GPU hangs off one of them: its PCI root port, and the
memory controller its pinned host buffers live behind, belong to one socket. A rank whose
Python thread, kernel-launch path and data loading run on the cores of that node touches local
memory and keeps its caches warm; left free, the scheduler moves it across sockets. ``torchrun``
does not bind by default (its ``--numa-binding`` is opt-in), so a rank that binds itself can run
a launch-bound loop faster than the same loop under ``torchrun``.

Where the cores come from: the GPU's PCI bus id (NVML through ``pynvml`` when importable, else
``nvidia-smi --query-gpu=index,pci.bus_id``), then sysfs:
``/sys/bus/pci/devices/<domain:bus:dev.fn>/numa_node`` and ``local_cpulist``. No CUDA context is
created, so this is safe in a process that must stay CUDA-free until its first cell.

Memory is not bound explicitly: Linux places a page on the node of the CPU that first touches it,
so a thread bound to the GPU's node allocates there by default.

The mode reaches a rank through the environment (set by the launcher, read here):
:data:`CPU_BIND_ENV` (``numa`` or ``none``) and :data:`GPU_INDEX_ENV`, the physical GPU index as
``nvidia-smi`` numbers it (before any CUDA_VISIBLE_DEVICES remapping).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

from ..common import env_vars

logger = logging.getLogger(__name__)

CPU_BIND_ENV = env_vars.CPU_BIND.name
GPU_INDEX_ENV = env_vars.GPU_INDEX.name
MODES = ("numa", "none")
PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_SMI_TIMEOUT_S = 10.0
#: How the reason starts when the machine has a single NUMA node (or hides them): not a problem.
NO_NODE = "no NUMA placement"


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a kernel cpulist string: ``"0-3,8-11"`` -> {0, 1, 2, 3, 8, 9, 10, 11}.

    The format of sysfs ``cpulist`` files and of ``taskset -c``: comma-separated CPU numbers and
    inclusive ranges, ranges optionally strided (``"0-15:4"`` -> 0, 4, 8, 12). An empty string
    (a node without CPUs) gives the empty set. Anything else raises ValueError naming the part.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            span, _, stride_text = part.partition(":")
            stride = int(stride_text) if stride_text else 1
            if "-" in span:
                first_text, last_text = span.split("-", 1)
                first, last = int(first_text), int(last_text)
            else:
                first = last = int(span)
        except ValueError:
            raise ValueError(f"not a cpulist: {text!r} (bad part {part!r}; expected e.g. '0-3,8-11')") from None
        if first < 0 or last < first or stride < 1:
            raise ValueError(f"not a cpulist: {text!r} (bad range {part!r})")
        cpus.update(range(first, last + 1, stride))
    return cpus


def format_cpulist(cpus: set[int] | list[int]) -> str:
    """The inverse of :func:`parse_cpulist` (no strides): {0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's and nvidia-smi's ``00000000:18:00.0`` as sysfs names it: ``0000:18:00.0``
    (4-digit domain, lower case)."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected e.g. 00000000:18:00.0)")
    return f"{int(domain, 16):04x}:{rest}"


def _bus_ids_from_nvml() -> dict[int, str] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            ids = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                info = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
                bus_id = info.busId
                ids[index] = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
            return ids
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError and its many subclasses: fall back to nvidia-smi
        logger.debug("NVML could not list the GPUs' PCI bus ids (%s); asking nvidia-smi", exc)
        return None


def _bus_ids_from_nvidia_smi() -> tuple[dict[int, str] | None, str]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi is not on PATH (and pynvml is not importable)"
    try:
        out = subprocess.run([exe, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi failed: {exc}"
    if out.returncode != 0:
        return None, f"nvidia-smi exited with {out.returncode}: {(out.stderr or out.stdout).strip()[:300]}"
    ids: dict[int, str] = {}
    for line in out.stdout.splitlines():
        index, _, bus_id = (s.strip() for s in line.partition(","))
        if index.isdigit() and bus_id:
            ids[int(index)] = bus_id
    return ids, "" if ids else f"nvidia-smi listed no GPU: {out.stdout.strip()[:300]!r}"


def gpu_bus_ids() -> tuple[dict[int, str], str]:
    """Every GPU's PCI bus id by physical index, and why none could be had ("" when some were)."""
    ids = _bus_ids_from_nvml()
    if ids:
        return ids, ""
    smi_ids, why = _bus_ids_from_nvidia_smi()
    return smi_ids or {}, why


def cpus_for_bus_id(bus_id: str, devices: str = PCI_DEVICES) -> tuple[set[int] | None, str]:
    """The CPUs local to one PCI device, and why not ("" when found).

    None when the machine gives no NUMA placement for it: ``numa_node`` is -1 (one node, or a
    VM that hides the topology; then there is nothing to gain by binding) or a file is missing.
    """
    path = os.path.join(devices, sysfs_bus_id(bus_id))
    try:
        with open(os.path.join(path, "numa_node")) as fh:
            node = int(fh.read().strip())
    except (OSError, ValueError) as exc:
        return None, f"no NUMA node for PCI device {bus_id}: {exc}"
    if node < 0:
        return None, f"{NO_NODE}: PCI device {bus_id} has none ({path}/numa_node is {node}: one node or hidden)"
    for cpulist in (os.path.join(path, "local_cpulist"), f"/sys/devices/system/node/node{node}/cpulist"):
        try:
            with open(cpulist) as fh:
                cpus = parse_cpulist(fh.read())
        except (OSError, ValueError) as exc:
            logger.debug("could not read %s: %s", cpulist, exc)
            continue
        if cpus:
            return cpus, ""
    return None, f"no CPU list for NUMA node {node} of PCI device {bus_id}"


def cpus_for_gpu(index: int) -> set[int] | None:
    """The CPU cores of the NUMA node of physical GPU ``index`` (nvidia-smi's numbering), or None
    when that cannot be known (no nvidia-smi or NVML, no such GPU, numa_node -1, ...): the reason
    is logged at INFO. Not intersected with this process's allowed CPUs (see apply_cpu_bind).

    nvidia-smi numbers GPUs in PCI bus order; CUDA does too when CUDA_DEVICE_ORDER=PCI_BUS_ID or
    when all GPUs are the same model (its default, fastest first, then breaks ties by bus id)."""
    cpus, why = _cpus_for_gpu(index)
    if cpus is None:
        logger.info("no CPU cores known for GPU %d: %s", index, why)
    return cpus


def _cpus_for_gpu(index: int) -> tuple[set[int] | None, str]:
    ids, why = gpu_bus_ids()
    if index not in ids:
        return None, why or f"there is no GPU {index} (GPUs seen: {sorted(ids)})"
    return cpus_for_bus_id(ids[index])


def _bind_all_threads(cpus: set[int]) -> None:
    """Every thread of this process to ``cpus``: ``sched_setaffinity(0)`` sets the calling thread
    only (threads started later inherit it); threads already running are set one by one."""
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError as exc:
        logger.debug("could not list this process's threads (%s); only the calling thread is bound", exc)
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as exc:  # a thread that ended meanwhile
            logger.debug("could not bind thread %d: %s", tid, exc)


def apply_cpu_bind(mode: str, gpu_index: int | None) -> set[int] | None:
    """Bind this process to the CPU cores of GPU ``gpu_index``'s NUMA node (mode ``numa``), or
    leave it as it is (mode ``none``). Returns the CPUs bound to, or None when nothing changed.

    The cores are intersected with the CPUs this process may use already (a cgroup, taskset or
    a scheduler's allocation stays in force), and the binding is never empty: when the
    intersection is, or the cores are unknown (see :func:`cpus_for_gpu`), nothing changes and a
    warning says why. A CPU rank (``gpu_index`` None) is not bound. Unknown modes raise
    ValueError. Call it before threads are started: they inherit it (threads that already run
    are rebound too).
    """
    if mode not in MODES:
        raise ValueError(f"unknown CPU binding mode {mode!r}: use one of {', '.join(MODES)}")
    if mode == "none":
        return None
    if gpu_index is None:
        logger.info("CPU binding 'numa' asked for a process without a GPU (a CPU rank): not bound")
        return None
    local, why = _cpus_for_gpu(gpu_index)
    if local is None:
        # One NUMA node (numa_node -1): nothing to gain, nothing to warn about.
        level = logging.INFO if why.startswith(NO_NODE) else logging.WARNING
        logger.log(level, "CPU binding 'numa' for GPU %d: not bound, its NUMA node's cores are unknown: %s",
                   gpu_index, why)
        return None
    allowed = os.sched_getaffinity(0)
    cpus = local & allowed
    if not cpus:
        logger.warning("CPU binding 'numa' for GPU %d: not bound, none of its node's CPUs (%s) is allowed "
                       "to this process (%s)", gpu_index, format_cpulist(local), format_cpulist(allowed))
        return None
    if cpus != allowed:
        _bind_all_threads(cpus)
    return cpus


def apply_from_env(environ: dict[str, str] | None = None) -> tuple[str, set[int] | None]:
    """apply_cpu_bind from :data:`CPU_BIND_ENV` and :data:`GPU_INDEX_ENV`, as a rank does at start.

    Returns the mode read ("" when unset: nothing is done) and the CPUs bound to. Without
    GPU_INDEX_ENV (which every launcher of clorch sets: the rank's own GPU, wherever CUDA_VISIBLE_DEVICES,
    which lists its host's GPUs as under torchrun, puts it), a CUDA_VISIBLE_DEVICES of one GPU
    stands for it. An index or a ``GPU-...`` UUID (looked up with nvidia-smi). Bad values raise
    ValueError.
    """
    env = os.environ if environ is None else environ
    mode = env.get(CPU_BIND_ENV, "").strip().lower()
    if not mode:
        return "", None
    if mode not in MODES:
        raise ValueError(f"{CPU_BIND_ENV}={mode!r}: unknown CPU binding mode, use one of {', '.join(MODES)}")
    if mode == "none":  # the default: costs a rank nothing, whatever GPU_INDEX_ENV holds
        return mode, None
    text = env.get(GPU_INDEX_ENV, "").strip()
    if not text:
        visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
        text = visible if visible.isdigit() or (visible.startswith("GPU-") and "," not in visible) else ""
    if text.startswith("GPU-"):  # CUDA_VISIBLE_DEVICES may name a GPU by its UUID
        index = gpu_index_for_uuid(text)
        if index is None:
            raise ValueError(f"{GPU_INDEX_ENV}={text!r}: no GPU with that UUID is listed by nvidia-smi")
        text = str(index)
    if text and not text.isdigit():
        raise ValueError(f"{GPU_INDEX_ENV}={text!r} is not a GPU index (a whole number, e.g. 0, or a GPU-... UUID)")
    return mode, apply_cpu_bind(mode, int(text) if text else None)


def gpu_index_for_uuid(uuid: str) -> int | None:
    """nvidia-smi's index of the GPU with this UUID (``GPU-8b1e...``), or None (the reason logged)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        logger.info("cannot look up GPU %s: nvidia-smi is not on PATH", uuid)
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("cannot look up GPU %s: nvidia-smi failed: %s", uuid, exc)
        return None
    for line in out.splitlines():
        index, _, found = (s.strip() for s in line.partition(","))
        if index.isdigit() and found.lower() == uuid.lower():
            return int(index)
    return None


def bind_rank() -> set[int] | None:
    """Apply the CPU binding the launcher asked for (CPU_BIND_ENV) to this rank, before its
    threads start. A binding that cannot be done costs speed, not correctness: it never stops the
    rank; the reason goes to the rank's log (stderr here), as does the set bound to."""
    who = f"rank {os.environ.get('RANK', '?')}"
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(logging.Formatter(f"clorch_repl: {who}: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    logger.propagate = False  # once, here, not again through logging's last-resort handler
    try:
        mode, cpus = apply_from_env()
        if cpus is not None:
            sys.__stderr__.write(f"clorch_repl: {who}: bound to CPUs {format_cpulist(cpus)} "
                                 f"({CPU_BIND_ENV}={mode}, the NUMA node of its GPU)\n")
        return cpus
    except Exception as exc:  # a bad variable, an unreadable sysfs, a refused sched_setaffinity
        sys.__stderr__.write(f"clorch_repl: {who}: warning: CPU binding {CPU_BIND_ENV}="
                             f"{os.environ.get(CPU_BIND_ENV)!r} {GPU_INDEX_ENV}="
                             f"{os.environ.get(GPU_INDEX_ENV)!r} not applied ({type(exc).__name__}: {exc}); "
                             "the rank runs unbound\n")
        return None
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        try:
            sys.__stderr__.flush()
        except (OSError, ValueError) as exc:  # no log to flush to: nothing else to tell it to
            logger.debug("flushing the rank's log failed: %s", exc)
