"""The CUDA driver's checkpoint API (``cuCheckpointProcess*``), called through ctypes from another
process with the target's pid: what ``%clorch suspend`` and ``%clorch resume`` rest on.

Why the driver and not a save: the driver copies a live process's whole GPU state (every
allocation, the caching allocator's pools, streams, contexts, NCCL's buffers) to host memory it
manages, releases the GPU, and later maps everything back at the same addresses; the process never
notices (measured for issue 37: a torch process holding 20 GiB, out in 15.6 s, back in 5.1 s, its
tensors exact). Nothing of the user's code has to know how to save or load its state.

Why a helper process (``python -m clorch_repl.host.cuda_checkpoint``) rather than the notebook's own:
the calls need ``cuInit(0)`` in the calling process, and a process that has initialised the CUDA
driver cannot hand CUDA to the children it forks (a notebook's multiprocessing or DataLoader
workers); the notebook stays CUDA-free (:mod:`clorch_repl.cuda`). Only :func:`api_problem`, which
reads the driver's version and its symbols without ``cuInit``, runs in the notebook.

The API (CUDA 12.8, drivers 570 and later; NVIDIA's cuda-checkpoint README and the driver API's
"CUDA Checkpointing" section): lock (new CUDA calls of the process block; submitted work
finishes), checkpoint (device memory copied to host, GPU resources released), restore (GPUs
acquired again, memory copied back to its original addresses), unlock. Each call takes a pointer
to a 64-byte argument struct that must be zeroed apart from the lock's ``timeoutMs``. Restore with
no GPU pairs puts the process back on the GPUs it was checkpointed from: never silently another.
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..common import env_vars

logger = logging.getLogger(__name__)

#: The driver library every NVIDIA driver installs.
LIBRARY = "libcuda.so.1"
#: What a driver without the API is told to get.
NEEDED = "an NVIDIA driver with CUDA 12.8's checkpoint API (driver 570 or later)"
SYMBOLS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
           "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState")
#: Size of every argument struct (CUcheckpointLockArgs & co.: 64 bytes, zeroed but the lock's timeout).
ARGS_BYTES = 64
#: How long a lock waits for the process's CUDA calls in flight (a lock with no timeout can wait forever).
LOCK_TIMEOUT_MS = 60_000


class ProcessState(enum.IntEnum):
    """CUprocessState."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4  # newer drivers
    RESTORING = 5


class CheckpointError(RuntimeError):
    """A driver call failed; the message names the rank, its host, the call and the driver's words."""


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Args(ctypes.Structure):
    """CUcheckpointCheckpointArgs, CUcheckpointRestoreArgs (no GPU pairs), CUcheckpointUnlockArgs: zeros."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


assert ctypes.sizeof(_LockArgs) == ctypes.sizeof(_Args) == ARGS_BYTES


def _load(library: Any = None) -> Any:
    return library if library is not None else ctypes.CDLL(LIBRARY)


def driver_version(lib: Any) -> str:
    """"12.6" from cuDriverGetVersion (which needs no cuInit); "unknown" where it fails."""
    version = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return "unknown"
    except AttributeError:
        return "unknown"
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def api_problem(library: Any = None) -> str | None:
    """Why this host's driver cannot checkpoint a process ("" never: None when it can). Loads the
    library and looks its symbols up; never calls cuInit (safe in the notebook's process)."""
    try:
        lib = _load(library)
    except OSError as exc:
        return f"the CUDA driver library ({LIBRARY}) cannot be loaded ({exc}); suspending needs {NEEDED}"
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        return (f"the CUDA driver here (CUDA {driver_version(lib)}) has no {missing[0]}; suspending needs "
                f"{NEEDED}")
    return None


class Driver:
    """The checkpoint calls on one library handle (``library``: a loaded CDLL; the real
    libcuda.so.1 by default)."""

    def __init__(self, library: Any = None) -> None:
        problem = api_problem(library)
        if problem:
            raise CheckpointError(problem)
        self.lib = _load(library)
        self._init_lock = threading.Lock()
        self._initialised = False

    def _describe(self, result: int) -> str:
        text, name = ctypes.c_char_p(), ctypes.c_char_p()
        said = []
        if self.lib.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
            said.append(name.value.decode(errors="replace"))
        if self.lib.cuGetErrorString(result, ctypes.byref(text)) == 0 and text.value:
            said.append(text.value.decode(errors="replace"))
        return ": ".join(said) or f"CUresult {result}"

    def _check(self, result: int, call: str, where: str) -> None:
        if result != 0:
            raise CheckpointError(f"{where}: {call} failed with {self._describe(result)}")

    def init(self, where: str) -> None:
        """cuInit(0), once (the driver requires it in the calling process before a restore)."""
        with self._init_lock:
            if not self._initialised:
                self._check(self.lib.cuInit(0), "cuInit(0)", where)
                self._initialised = True

    def state(self, pid: int, where: str) -> ProcessState:
        value = ctypes.c_int(0)
        self._check(self.lib.cuCheckpointProcessGetState(int(pid), ctypes.byref(value)),
                    f"cuCheckpointProcessGetState({pid})", where)
        try:
            return ProcessState(value.value)
        except ValueError:
            raise CheckpointError(f"{where}: the driver reports process {pid} in state {value.value}, which "
                                  "clorch_repl does not know; %clorch stop and start afresh") from None

    def _step(self, call: str, pid: int, args: ctypes.Structure, where: str) -> float:
        t0 = time.monotonic()
        self._check(getattr(self.lib, call)(int(pid), ctypes.byref(args)), f"{call}({pid})", where)
        return time.monotonic() - t0

    def suspend(self, pid: int, where: str, lock_timeout_ms: int = LOCK_TIMEOUT_MS) -> dict[str, float]:
        """Lock, then checkpoint ``pid``: its GPU memory in host memory, its GPUs free. A failed
        checkpoint unlocks it again (the process runs on as before). Returns each step's seconds."""
        self.init(where)
        state = self.state(pid, where)
        if state is not ProcessState.RUNNING:
            raise CheckpointError(f"{where}: its CUDA state is {state.name.lower()}, not running; "
                                  "%clorch resume first if it was suspended")
        lock = _LockArgs(timeoutMs=lock_timeout_ms)
        times = {"lock": self._step("cuCheckpointProcessLock", pid, lock, where)}
        try:
            times["checkpoint"] = self._step("cuCheckpointProcessCheckpoint", pid, _Args(), where)
        except CheckpointError:
            try:
                self._step("cuCheckpointProcessUnlock", pid, _Args(), where)
            except CheckpointError as again:
                logger.warning("unlocking after a failed checkpoint failed too: %s", again)
            raise
        return times

    def resume(self, pid: int, where: str) -> dict[str, float]:
        """Restore ``pid`` onto the GPUs it was checkpointed from, then unlock it."""
        self.init(where)
        state = self.state(pid, where)
        if state is not ProcessState.CHECKPOINTED:
            raise CheckpointError(f"{where}: its CUDA state is {state.name.lower()}, not checkpointed: "
                                  "nothing to resume")
        times = {"restore": self._step("cuCheckpointProcessRestore", pid, _Args(), where)}
        times["unlock"] = self._step("cuCheckpointProcessUnlock", pid, _Args(), where)
        return times


@dataclass
class Outcome:
    """One process's suspend or resume, as the helper reports it."""

    pid: int
    where: str
    ok: bool
    seconds: dict[str, float]
    error: str = ""


def act(driver: Driver, action: str, targets: Sequence[tuple[int, str]]) -> list[Outcome]:
    """``action`` (suspend, resume, state) on every ``(pid, where)`` at once, one thread each:
    the driver copies each process's memory over its own GPU's link."""
    results: dict[int, Outcome] = {}

    def one(pid: int, where: str) -> None:
        try:
            if action == "state":
                seconds = {"state": float(driver.state(pid, where))}
            else:
                seconds = getattr(driver, action)(pid, where)
            results[pid] = Outcome(pid, where, True, seconds)
        except CheckpointError as exc:
            results[pid] = Outcome(pid, where, False, {}, str(exc))

    threads = [threading.Thread(target=one, args=target, name=f"checkpoint-{target[0]}") for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[pid] for pid, _ in targets]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m clorch_repl.host.cuda_checkpoint suspend|resume|state PID=WHERE ...``: one JSON line
    per process on stdout; exit status 0 when every one succeeded."""
    parser = argparse.ArgumentParser(prog="python -m clorch_repl.host.cuda_checkpoint")
    parser.add_argument("action", choices=("suspend", "resume", "state"))
    parser.add_argument("targets", nargs="+", metavar="PID=WHERE")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # never stopped midway: a process left locked is worse
    targets = []
    for text in args.targets:
        pid, _, where = text.partition("=")
        if not pid.isdigit():
            parser.error(f"a target is PID=WHERE; got {text!r}")
        targets.append((int(pid), where or f"pid {pid}"))
    try:
        driver = Driver()
    except CheckpointError as exc:
        outcomes = [Outcome(pid, where, False, {}, f"{where}: {exc}") for pid, where in targets]
    else:
        outcomes = act(driver, args.action, targets)
    for outcome in outcomes:
        print(json.dumps(asdict(outcome)), flush=True)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    logging.basicConfig(level=env_vars.LOG_LEVEL.get())
    sys.exit(main())
