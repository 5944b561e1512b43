"""The processes of a session: one worker kernel per rank, started, watched and stopped here.

This module owns process lifecycle only (the jupyter_client ``KernelManager`` of each rank, its
environment, log file and pid). It never reads a message: channels belong to :mod:`.relay`.

Each rank's kernelspec starts :mod:`.supervisor`, which starts the kernel as its child: the
process jupyter_client knows (``RankProcess.pid``) is the supervisor, whose exit status mirrors
the kernel's; ``RankProcess.kernel_pid`` is the rank's Python process itself (stack dumps,
``%clorch status``, GPU memory). The supervisor is what ends everything a rank started, daemons
included, when the rank is stopped or the notebook dies.
"""

from __future__ import annotations

import io
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from .. import procs
from ..rendezvous import STORE_FILE_ENV, loopback_socket_env
from ..topology import Topology
from . import supervisor
from .worker import STACK_FILE_ENV

logger = logging.getLogger(__name__)

KERNEL_NAME = "clorch-rank"
STOP_GRACE_S = 5.0
#: How long ranks get to leave after a shutdown request before they are sent SIGTERM (part of
#: the one shared grace period of a stop, not added to it).
SHUTDOWN_WAIT_S = 1.5


@dataclass
class RankProcess:
    """One rank's kernel process and the files that belong to it."""

    rank: int
    device: int | None
    manager: KernelManager
    log_path: str
    stack_path: str
    pid_path: str = ""
    #: Where this process's part of the log begins (after its start banner): a restart appends
    #: to the same log, and a death report must show only what the dead process wrote.
    log_start: int = 0
    started_at: float = field(default_factory=time.time)
    returncode: int | None = None
    _kernel_pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The supervisor's pid: the process jupyter_client started and signals."""
        process = getattr(self.manager.provisioner, "process", None)
        return getattr(process, "pid", None)

    @property
    def kernel_pid(self) -> int | None:
        """The rank's own Python process (the supervisor writes it into ``pid_path`` after the
        fork, long before the kernel answers); None until it is known."""
        if self._kernel_pid is None and self.pid_path:
            self._kernel_pid = supervisor.read_pid(self.pid_path)
        return self._kernel_pid

    def poll(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal)."""
        if self.returncode is None:
            process = getattr(self.manager.provisioner, "process", None)
            if process is not None:
                self.returncode = process.poll()
            elif not self.manager.has_kernel:
                self.returncode = -signal.SIGKILL
        return self.returncode

    @property
    def alive(self) -> bool:
        return self.poll() is None


def main_thread_stack(dump: str) -> str:
    """The main thread's part of a faulthandler dump of every thread: that is where a cell runs.
    The kernel's own threads (iopub, shell channel, heartbeat, watchdogs) only bury it."""
    sections: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            sections.append([line])
        elif sections and line.strip():
            sections[-1].append(line)
    for section in sections:
        if any("_run_module_as_main" in line or "clorch_repl/session/worker.py" in line for line in section):
            return "\n".join(trim_kernel_frames(section))
    return dump


def trim_kernel_frames(lines: list[str]) -> list[str]:
    """Cut a faulthandler stack (most recent call first) where the cell's code was called from
    IPython: what lies below is the same kernel machinery in every dump."""
    for i, line in enumerate(lines):
        if "IPython/core/interactiveshell.py" in line and " in run_code" in line:
            return [*lines[:i], "  ... (the kernel's own frames)"]
    return lines


#: A death report shows at most this much of one log line (a progress bar never ended, a dump).
REPORT_LINE_CHARS = 2000


def _clip(line: str, rank: int) -> str:
    if len(line) <= REPORT_LINE_CHARS:
        return line
    return f"... ({len(line) - REPORT_LINE_CHARS} characters more; %clorch logs {rank}) {line[-REPORT_LINE_CHARS:]}"


def _private_file(path: str) -> int:
    """Open ``path`` for appending, readable by this user only (0600), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class WorkerGroup:
    """Starts, watches and stops the worker kernels of one topology.

    Every file of the group (connection files, IPC sockets, logs, stack dumps) lives in one
    private directory (0700) that :meth:`stop` removes. Workers talk over IPC sockets in that
    directory: nothing listens on a network port, and only this user can connect.
    """

    def __init__(self, topology: Topology, *, workdir: str | None = None) -> None:
        self.topology = topology
        self.dir = workdir or tempfile.mkdtemp(prefix="clorch-")
        os.chmod(self.dir, 0o700)
        self.master_port = procs.free_port()
        #: the group's rendezvous (see clorch_repl.rendezvous): private, and new for every start
        self.store_file = os.path.join(self.dir, f"rendezvous-{secrets.token_hex(8)}.store")
        self.ranks: list[RankProcess] = []
        self._spec_manager = self._write_kernelspec()

    def _write_kernelspec(self) -> KernelSpecManager:
        spec_dir = os.path.join(self.dir, "kernels", KERNEL_NAME)
        os.makedirs(spec_dir, exist_ok=True)
        # The supervisor watches this process (the notebook kernel, which starts every rank).
        spec = {
            "argv": supervisor.command(sys.executable, STOP_GRACE_S, os.getpid(),
                                       [sys.executable, "-m", "clorch_repl.session.worker", "-f", "{connection_file}"],
                                       pid_file="{connection_file}.pid", session_dir=self.dir),
            "display_name": "clorch_repl rank",
            "language": "python",
            "interrupt_mode": "signal",
        }
        with open(os.path.join(spec_dir, "kernel.json"), "w") as fh:
            json.dump(spec, fh)
        return KernelSpecManager(kernel_dirs=[os.path.join(self.dir, "kernels")])

    def rank_env(self, rank: int) -> dict[str, str]:
        """The environment of one rank: the launcher contract of API.md, plus our plumbing."""
        topo = self.topology
        env = dict(os.environ)
        env.update({
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(topo.nproc),
            "LOCAL_WORLD_SIZE": str(topo.nproc),
            "MASTER_ADDR": procs.LOOPBACK,
            "MASTER_PORT": str(self.master_port),
            "CUDA_VISIBLE_DEVICES": topo.visible_devices(rank),
            "CLORCH_DIST_BACKEND": topo.backend,
            "CLORCH_DIST_TIMEOUT_MS": str(int(topo.timeout_s * 1000)),
            STACK_FILE_ENV: os.path.join(self.dir, f"rank{rank}.stack"),
            STORE_FILE_ENV: self.store_file,
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if topo.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun and launch() do
        for key, value in loopback_socket_env().items():
            env.setdefault(key, value)
        return env

    def launch(self) -> None:
        """Start every rank's kernel process; returns at once (readiness is the relay's job)."""
        for rank in range(self.topology.nproc):
            log_path = os.path.join(self.dir, f"rank{rank}.log")
            stack_path = os.path.join(self.dir, f"rank{rank}.stack")
            os.close(_private_file(stack_path))
            manager = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=self._spec_manager,
                                    transport="ipc", ip=os.path.join(self.dir, f"rank{rank}"))
            manager.connection_file = os.path.join(self.dir, f"rank{rank}.json")
            log_fd = _private_file(log_path)
            try:
                with open(log_fd, "ab", closefd=False) as log:
                    log.write(f"--- clorch_repl: rank {rank} starting at {time.ctime()} ---\n".encode())
                log_start = os.fstat(log_fd).st_size  # the kernel appends from here
                manager.start_kernel(env=self.rank_env(rank), stdout=log_fd, stderr=log_fd,
                                     cwd=os.getcwd())
            finally:
                os.close(log_fd)
            self.ranks.append(RankProcess(rank, self.topology.devices[rank], manager, log_path, stack_path,
                                          pid_path=os.path.realpath(manager.connection_file) + ".pid",
                                          log_start=log_start))

    def dead(self) -> list[RankProcess]:
        return [r for r in self.ranks if not r.alive]

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """SIGINT to each chosen rank's process group (KeyboardInterrupt in its running cell)."""
        for proc in self._select(ranks):
            if proc.alive:
                try:
                    proc.manager.interrupt_kernel()
                except Exception as exc:  # a rank dying right now: its death is reported elsewhere
                    logger.debug("interrupting rank %d failed: %s", proc.rank, exc)

    def dump_stack(self, rank: int, wait_s: float = 0.5) -> str:
        """Where a rank's threads are right now, from its faulthandler (works while it is stuck in C)."""
        proc = self.ranks[rank]
        pid = proc.kernel_pid or proc.pid
        if pid is None or not proc.alive:
            return ""
        start = os.path.getsize(proc.stack_path)
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + wait_s
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with open(proc.stack_path, "rb") as fh:
                fh.seek(start)
                text = fh.read().decode(errors="replace")
            if text.endswith("\n\n") or ("Current thread" in text and text.endswith("\n")):
                break
        return main_thread_stack(text)

    def log_tail(self, rank: int, lines: int | None = 200) -> str:
        """The last ``lines`` lines of the rank's log (all of it with ``None``).

        This is the whole log, earlier processes of the rank included: a restart appends to it
        (each process's part starts with a "--- clorch_repl: rank N starting at ... ---" line),
        so ``%clorch logs`` still shows what happened before the restart. A death report wants
        only the current process's part: see :meth:`current_log_tail`."""
        with open(self.ranks[rank].log_path, "rb") as fh:
            return procs.tail_bytes(fh, lines).decode(errors="replace")

    def current_log_tail(self, rank: int, lines: int) -> str:
        """The last ``lines`` lines that the rank's current process wrote: nothing from before its
        start banner (``RankProcess.log_start``), so a rank that dies after ``%clorch restart``
        is not reported with an earlier process's tracebacks. Reads at most
        ``procs.TAIL_MAX_BYTES`` from the end, as :meth:`log_tail` does."""
        proc = self.ranks[rank]
        with open(proc.log_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(proc.log_start, size - procs.TAIL_MAX_BYTES)
            fh.seek(start)
            data = fh.read(size - start)
        return procs.tail_bytes(io.BytesIO(data), lines).decode(errors="replace")

    def death_report(self, rank: int, lines: int = 15) -> str:
        """What a dead rank's log says about its end: the faulthandler report of a crash (its
        first, most recent frames, which are the user's) when there is one, else the last lines.
        Only the dead process's own lines: never those of the rank's processes before a restart."""
        tail = self.current_log_tail(rank, 400).splitlines()
        starts = [i for i, line in enumerate(tail) if line.startswith("Fatal Python error")]
        if not starts:
            return "\n".join(_clip(line, rank) for line in tail[-lines:])
        report = [line for line in tail[starts[-1]:] if not line.startswith("Extension modules")]
        return "\n".join(_clip(line, rank) for line in trim_kernel_frames(report)[:lines])

    def stop(self, grace_s: float = STOP_GRACE_S, *, keep_dir: bool = False) -> list[int]:
        """End every rank and everything it started, then remove the group's directory.

        All ranks are stopped at once, sharing one grace period (a stop costs one grace period,
        not one per rank): a shutdown request to every kernel, up to :data:`SHUTDOWN_WAIT_S` for
        them to leave, then SIGTERM to every supervisor that is still running (each passes it to
        its kernel and every descendant, daemons included, and SIGKILLs them after its own
        ``--grace``), and at ``grace_s`` SIGKILL to whatever is left of the supervisors, their
        process groups and the process trees seen below them. Returns the pids that were still
        running at the end, which should be none. ``keep_dir`` keeps the logs (a restart appends).
        """
        start = time.monotonic()
        sups = [p.pid for p in self.ranks if p.pid is not None]
        kernels = [p.kernel_pid for p in self.ranks if p.kernel_pid is not None]
        for proc in self.ranks:
            if proc.alive:
                try:
                    proc.manager.request_shutdown()
                except Exception as exc:  # its channel is gone: SIGTERM follows anyway
                    logger.debug("shutdown request to rank %d failed: %s", proc.rank, exc)
        procs.wait_gone(kernels, timeout_s=min(grace_s, SHUTDOWN_WAIT_S))
        trees = {pid: procs.process_tree(pid) for pid in sups}  # before anything re-parents
        for pid in sups:
            if procs.pid_running(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        # The supervisors have their own grace (the same STOP_GRACE_S); give them a little more
        # to finish their SIGKILLs before ours.
        procs.wait_gone(sups, timeout_s=max(0.0, grace_s + 0.5 - (time.monotonic() - start)))
        for pid, tree in trees.items():
            procs.kill_tree(pid, tree)
        for proc in self.ranks:
            proc.poll()
            try:
                proc.manager.cleanup_resources()
            except Exception as exc:  # leftover sockets or files of a dead kernel
                logger.debug("cleaning up rank %d failed: %s", proc.rank, exc)
        left = procs.wait_gone(sups + kernels + [p.pid for t in trees.values() for p in t], timeout_s=2.0)
        try:
            os.unlink(self.store_file)  # a restart keeps the directory; never its old keys
        except FileNotFoundError:
            pass
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return sorted(set(left))

    def _select(self, ranks: list[int] | None) -> list[RankProcess]:
        return self.ranks if ranks is None else [self.ranks[r] for r in ranks]
