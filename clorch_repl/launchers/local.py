"""The ``local`` launcher: every rank is a child of the notebook kernel, on this host.

This is today's fast path. Each rank's kernel is started by a jupyter_client ``KernelManager``
whose kernelspec runs :mod:`.supervisor`, which starts the kernel as its child: the process
jupyter_client knows is the supervisor, whose exit status mirrors the kernel's; the kernel's own
pid comes from the supervisor's pid file (stack dumps, ``%clorch status``). The supervisor is what
ends everything a rank started, daemons included, when the rank is stopped or the notebook dies.

Every file of the group (connection files, IPC sockets, logs, stack dumps, the rendezvous store)
lives in one private directory (0700) that :meth:`LocalLauncher.close` removes. Ranks talk over IPC
sockets in that directory: nothing listens on a network port, and only this user can connect;
every message is HMAC-signed with the kernel's key.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from .. import procs
from ..atomic import remove_quietly
from ..rank_env import RankPlace, rank_environment
from ..topology import Topology
from . import supervisor
from .base import LaunchOptions, Launcher, Progress, RankHandle
from .rankfiles import RankFiles, kernel_pid

logger = logging.getLogger(__name__)

KERNEL_NAME = "clorch-rank"
STOP_GRACE_S = 5.0
#: How long ranks get to leave after a shutdown request before they are sent SIGTERM (part of
#: the one shared grace period of a stop, not added to it).
SHUTDOWN_WAIT_S = 1.5


class LocalRank(RankHandle):
    """One local rank: its kernel's ``KernelManager`` (whose process is the rank's supervisor)."""

    def __init__(self, rank: int, manager: KernelManager, files: RankFiles) -> None:
        self.rank = rank
        self.host = ""
        self.manager = manager
        self.files = files
        self.started_at = time.time()
        self.pid_path = os.path.realpath(manager.connection_file) + ".pid"
        self.returncode: int | None = None
        self._kernel_pid: int | None = None

    def connection_info(self, session: bool = False) -> dict[str, Any]:
        return self.manager.get_connection_info(session=session)

    def client(self) -> Any:
        return self.manager.client()

    @property
    def supervisor_pid(self) -> int | None:
        """The process jupyter_client started and signals."""
        process = getattr(self.manager.provisioner, "process", None)
        return getattr(process, "pid", None)

    @property
    def pid(self) -> int | None:
        """The rank's own Python process (known once the supervisor has forked it)."""
        if self._kernel_pid is None:
            self._kernel_pid = kernel_pid(self.pid_path)
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
    def exit(self) -> str | None:
        code = self.poll()
        return None if code is None else procs.describe_exit(code)


class LocalLauncher(Launcher):
    """Ranks as children of the notebook kernel (see the module docstring)."""

    name = "local"

    def __init__(self, topology: Topology, options: LaunchOptions | None = None) -> None:
        super().__init__(topology, options)
        self.dir = tempfile.mkdtemp(prefix="clorch-")
        os.chmod(self.dir, 0o700)
        self.ranks: list[LocalRank] = []  # type: ignore[assignment]
        self.files = [RankFiles(self.dir, r) for r in range(topology.nproc)]
        self.store_file = ""
        self.master_port = 0
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

    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """The environment of one rank (:mod:`clorch_repl.rank_env`), plus the stack file."""
        topo = self.topology
        env = rank_environment(RankPlace(
            rank=rank, local_rank=rank, world_size=topo.nproc, local_world_size=topo.nproc,
            master_addr=procs.LOOPBACK, master_port=master_port, backend=topo.backend,
            timeout_s=topo.timeout_s, gpu=topo.visible_devices(rank) or None, store_file=self.store_file,
            socket_ifname="lo", cpu_bind=topo.cpu_bind))
        from ..session.worker import STACK_FILE_ENV

        env[STACK_FILE_ENV] = self.files[rank].stack_path
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        return env

    def launch(self, progress: Progress) -> None:
        """Start every rank's kernel process; returns at once (readiness is the relay's job)."""
        # A fresh rendezvous for every start: a restart never reads a previous group's keys.
        self.store_file = os.path.join(self.dir, f"rendezvous-{secrets.token_hex(8)}.store")
        #: the group's MASTER_PORT (the ranks meet through the FileStore; torch's names are set too)
        self.master_port = master_port = procs.free_port()
        self.ranks = []
        for rank in range(self.topology.nproc):
            manager = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=self._spec_manager,
                                    transport="ipc", ip=os.path.join(self.dir, f"rank{rank}"))
            manager.connection_file = os.path.join(self.dir, f"rank{rank}.json")
            files = self.files[rank]
            log_fd = files.open_log()
            try:
                manager.start_kernel(env=self.rank_env(rank, master_port), stdout=log_fd, stderr=log_fd,
                                     cwd=os.getcwd())
            finally:
                os.close(log_fd)
            self.ranks.append(LocalRank(rank, manager, files))

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """SIGINT to each chosen rank's process group (KeyboardInterrupt in its running cell)."""
        for proc in self.ranks if ranks is None else [self.ranks[r] for r in ranks]:
            if proc.alive:
                try:
                    proc.manager.interrupt_kernel()
                except (OSError, RuntimeError) as exc:  # dying right now: reported elsewhere
                    logger.debug("interrupting rank %d failed: %s", proc.rank, exc)

    def dump_stack(self, rank: int) -> str:
        proc = self.ranks[rank]
        return proc.files.dump_stack(proc.pid or proc.supervisor_pid) if proc.alive else ""

    def log_tail(self, rank: int, lines: int | None = 200) -> str:
        return self.files[rank].log_tail(lines)

    def death_report(self, rank: int, lines: int = 15) -> str:
        return self.files[rank].death_report(lines)

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[str]:
        """End every rank and everything it started, all at once, sharing one grace period.

        A shutdown request to every kernel, up to :data:`SHUTDOWN_WAIT_S` for them to leave, then
        SIGTERM to every supervisor still running (each passes it to its kernel and every
        descendant, daemons included, and SIGKILLs them after its own ``--grace``), and at
        ``grace_s`` SIGKILL to whatever is left of the supervisors and the process trees seen
        below them. Returns the pids still running at the end (as text), which should be none.
        """
        start = time.monotonic()
        sups = [p.supervisor_pid for p in self.ranks if p.supervisor_pid is not None]
        kernels = [p.pid for p in self.ranks if p.pid is not None]
        for proc in self.ranks:
            if proc.alive:
                try:
                    proc.manager.request_shutdown()
                except (OSError, RuntimeError) as exc:  # its channel is gone: SIGTERM follows anyway
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
            except OSError as exc:  # leftover sockets or files of a dead kernel
                logger.debug("cleaning up rank %d failed: %s", proc.rank, exc)
        left = procs.wait_gone(sups + kernels + [p.pid for t in trees.values() for p in t], timeout_s=2.0)
        if left:
            logger.warning("clorch_repl: processes %s of the ranks outlived the stop", sorted(set(left)))
        if self.store_file:
            remove_quietly(self.store_file)  # a restart never reads the old group's keys
        return [f"process {pid} (sent SIGKILL)" for pid in sorted(set(left))]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
