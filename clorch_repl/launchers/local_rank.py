"""One rank of the ``local`` launcher (:mod:`.local`): its kernel's manager and files, and how
many ranks' deaths are learnt in one look.

Apart from the launcher because the look (:func:`ended`) runs before every cell for every rank,
and is a question about processes, not about starting or stopping them.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from typing import Any, Sequence

from jupyter_client import KernelManager

from ..common import procs
from ..host import supervisor
from ..host.rankfiles import RankFiles
from ..wire import serving
from .base import RankHandle

logger = logging.getLogger(__name__)


class LocalRank(RankHandle):
    """One local rank: its kernel's ``KernelManager`` (whose process is the rank's supervisor)."""

    def __init__(self, rank: int, manager: KernelManager, files: RankFiles) -> None:
        self.rank = rank
        self.host = ""
        self.manager = manager
        self.files = files
        self.started_at = time.time()
        self.pid_path = os.path.realpath(manager.connection_file) + ".pid"
        #: the kernel's "I serve requests" file (:mod:`clorch_repl.wire.serving`), resolved once
        self.serving_path = serving.serving_path(manager.connection_file)
        self.returncode: int | None = None
        self._process: Any = None
        self._kernel_pid: int | None = None
        #: the environment and working directory it was started with (a warm spare's are
        #: compared with what a cold rank would get now)
        self.env: dict[str, str] = {}
        self.cwd = ""
        #: a warm spare's own log, until it is made a rank
        self.log_path = ""

    def connection_info(self, session: bool = False) -> dict[str, Any]:
        return self.manager.get_connection_info(session=session)

    def client(self) -> Any:
        return self.manager.client()

    @property
    def process(self) -> Any:
        """The handle of the process jupyter_client started and signals (the supervisor): a
        ``Popen``, or a forked rank's :class:`~.forked.ForkedProcess`; None before it has one.
        Kept once known (the manager's provisioner is a traitlet, asked before every cell of every
        rank, :meth:`LocalLauncher.dead`): a manager here runs one process in its life (none is
        restarted in place), and its handle knows that process's exit after the manager let go."""
        if self._process is None:
            self._process = getattr(self.manager.provisioner, "process", None)
        return self._process

    @property
    def supervisor_pid(self) -> int | None:
        """The process jupyter_client started and signals."""
        return getattr(self.process, "pid", None)

    @property
    def pid(self) -> int | None:
        """The rank's own Python process (known once the supervisor has forked it)."""
        if self._kernel_pid is None:
            self._kernel_pid = supervisor.read_pid(self.pid_path)
        return self._kernel_pid

    @property
    def serving(self) -> bool:
        """Whether the kernel's event loop runs (:mod:`clorch_repl.wire.serving`): for a warm
        spare, that its imports and its shell are done and it can be made a rank without waiting."""
        return os.path.exists(self.serving_path)

    def poll(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal)."""
        if self.returncode is None:
            process = self.process
            if process is not None:
                self.returncode = process.poll()
            elif not self.manager.has_kernel:
                self.returncode = -signal.SIGKILL
        return self.returncode

    @property
    def exit(self) -> str | None:
        code = self.poll()
        return None if code is None else procs.describe_exit(code)


def ended(handles: Sequence[LocalRank]) -> list[int]:
    """The ranks of ``handles`` whose process has ended, in rank order (:meth:`Launcher.dead`).

    One ``poll`` of the forked ranks' pidfds for all of them: 0.47 us a rank, against 1.5 for
    each rank's own look through jupyter_client's provisioner (0.1 ms a cell at 64 ranks on the
    2-core box, spent before any rank had its request; issue 39). Ranks without a pidfd (fresh
    interpreters) and those whose pidfd woke are asked as :attr:`RankHandle.alive` asks. A pidfd
    is closed only once its process's exit status is known, so one found quiet whose status is
    known by then (another thread's look closed it, and its number may name another file now)
    is asked too."""
    watched: list[tuple[int, LocalRank, Any]] = []
    asked: list[LocalRank] = []
    for proc in handles:
        process = proc.process if proc.returncode is None else None
        fd = getattr(process, "exit_fd", None)
        if fd is None:
            asked.append(proc)
        else:
            watched.append((fd, proc, process))
    if watched:
        poller = select.poll()
        for fd, _, _ in watched:
            poller.register(fd, select.POLLIN)
        woke = {fd for fd, _ in poller.poll(0)}  # (POLLNVAL for one closed meanwhile)
        asked += [proc for fd, proc, process in watched if fd in woke or process.returncode is not None]
    return sorted(p.rank for p in asked if not p.alive)
