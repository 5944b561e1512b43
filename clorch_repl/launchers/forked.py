"""Local ranks forked from a zygote (issue 39): the notebook's side of :mod:`clorch_repl.host.zygote`.

A cold start of N ranks used to start N interpreters, each importing ipykernel and then, in its
join, torch: CPU that grew with N (about 1.26 s a rank at 8 ranks on the 2-core box). The local
launcher starts one zygote per session instead, which imports all of that once, and asks it for
each rank's supervisor. jupyter_client still owns each rank through its ``KernelManager``: the
kernelspec names :class:`ForkedProvisioner` (entry point ``clorch-forked-rank``), which asks the
zygote rather than ``Popen``, and whose process handle, :class:`ForkedProcess`, learns the
supervisor's exit status from the zygote (the supervisor is the zygote's child, not the notebook's).

Off with ``CLORCH_FORK_RANKS=0``: each rank is a fresh interpreter, as before.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib import metadata
from typing import Any, Callable

from jupyter_client.kernelspec import NoSuchKernel
from jupyter_client.provisioning import LocalProvisioner

from ..common import env_vars, workdir
from ..host import proctitle
from ..host.zygote import CLOSE_MESSAGE
from ..errors import ClorchError

logger = logging.getLogger(__name__)

#: the provisioner's entry point (pyproject.toml, group ``jupyter_client.kernel_provisioners``)
PROVISIONER = "clorch-forked-rank"
#: the keyword through which the launcher hands its zygote to the provisioner (start_kernel's kwargs)
ZYGOTE_KW = "clorch_zygote"
#: how long the zygote may take over its imports (torch's, cold, on a busy box) before a start fails
READY_S = 120.0
FORK_ENV = env_vars.FORK_RANKS.name
#: what the zygote runs (``python -m``)
ZYGOTE_MODULE = "clorch_repl.host.zygote"


class ZygoteError(ClorchError):
    """The zygote could not fork a rank: the launcher starts its ranks as fresh interpreters."""


def wanted() -> bool:
    """Whether ranks are forked from a zygote (``CLORCH_FORK_RANKS``, default 1; Linux only)."""
    return sys.platform.startswith("linux") and env_vars.FORK_RANKS.get() != "0"


def provisioner_registered() -> bool:
    """Whether jupyter_client can find :class:`ForkedProvisioner`: its entry point is registered
    only where clorch_repl is installed (``pip install``), not where it is merely on ``PYTHONPATH``.
    Asked before a zygote starts, so that such a checkout starts fresh interpreters quietly rather
    than through jupyter_client's logged ``NoSuchKernel`` traceback for every rank. Asked for
    every zygote a launcher starts, not cached: a ``pip install -e .`` under a running notebook
    counts from its next start (about 5 ms: it reads every installed package's entry points)."""
    return bool(metadata.entry_points(group="jupyter_client.kernel_provisioners", name=PROVISIONER))


class Zygote:
    """One zygote process and its socket: ``fork`` a rank's supervisor, learn each one's exit."""

    def __init__(self, log_path: str) -> None:
        #: what it was started with: a rank forked later must see what a fresh one would
        self.env, self.cwd, self.log_path = dict(os.environ), workdir.working_directory(), log_path
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._ready = False
        #: its end of the socket closed: it is gone (its supervisors end their ranks as orphans)
        self.gone = False
        #: :meth:`close` was called: a ``recv`` of another thread that fails now failed because of it
        self._closed = False
        #: every supervisor it forked
        self.forked: list[int] = []
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.process = subprocess.Popen(
                # ROOM: space for each forked rank's own command line (host.proctitle)
                [sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno()), proctitle.ROOM],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=self.env,
                cwd=self.cwd, start_new_session=True)
        finally:
            os.close(fd)
            theirs.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def stale(self) -> bool:
        """Whether it can no longer fork what a fresh rank would be: the notebook's environment or
        working directory changed since it started (its imports may have read them), or it died."""
        return self.process.poll() is not None or self.env != dict(os.environ) or not workdir.shares_folder(self.process.pid, self.cwd)

    def _receive(self, timeout_s: float | None) -> dict[str, Any] | None:
        """One message (exits filed away as they come); None on timeout or once it is gone."""
        if self.gone:
            return None
        if self._sock.gettimeout() != timeout_s:  # a syscall: asked once a rank before every cell
            self._sock.settimeout(timeout_s)
        try:
            data = self._sock.recv(1 << 16)
        except (socket.timeout, BlockingIOError):
            return None
        except OSError:
            if not self._closed:
                raise
            data = b""  # closed under it by an interrupted start's stop (see close): as if it were gone
        if not data:
            self.gone = True
            return None
        msg = json.loads(data)
        if "exited" in msg:
            self._exits[msg["exited"]] = msg["returncode"]
        elif "ready" in msg:
            self._ready = True
        return msg

    def fork(self, cmd: list[str], env: dict[str, str], cwd: str, log_fd: int) -> ForkedProcess:
        """A rank's supervisor forked with ``cmd`` (its supervisor command), ``env``, ``cwd``, and
        ``log_fd`` as its stdout and stderr; waits for the zygote's imports the first time."""
        with self._lock:
            deadline = time.monotonic() + READY_S
            while not self._ready:
                if self.gone or self.process.poll() is not None:
                    raise ZygoteError(f"the rank zygote ended ({self._ended()}) before a rank was forked{self._tail()}")
                if time.monotonic() > deadline:
                    raise ZygoteError(f"the rank zygote did not finish its imports within {READY_S:.0f} s")
                self._receive(0.1)
            request = json.dumps({"argv": cmd, "env": env, "cwd": cwd}).encode()
            socket.send_fds(self._sock, [request], [log_fd])
            while True:
                msg = self._receive(READY_S)
                if msg is None:
                    raise ZygoteError(f"the rank zygote ended ({self._ended()}){self._tail()}" if self.gone
                                      else "the rank zygote did not answer a fork request")
                if "pid" in msg:
                    self.forked.append(msg["pid"])
                    return ForkedProcess(msg["pid"], self)
                if "error" in msg:
                    raise ZygoteError(f"the rank zygote could not fork a rank: {msg['error']}")

    def _ended(self) -> str:
        """Its exit status, once its socket closed (it is exiting): collected, so no zombie is left."""
        try:
            return str(self.process.wait(timeout=2.0))
        except subprocess.TimeoutExpired:
            return "still exiting"

    def _tail(self, lines: int = 5) -> str:
        """The end of its log (why it ended: an import that failed), for the message that says so."""
        try:
            with open(self.log_path, errors="replace") as fh:
                tail = fh.read().splitlines()[-lines:]
        except OSError:
            return ""
        return "; its log ends with:\n" + "\n".join(tail) if tail else ""

    def returncode(self, pid: int) -> int | None:
        """``pid``'s exit status as Popen gives it, once the zygote reported it."""
        with self._lock:
            while pid not in self._exits and self._receive(0) is not None:
                pass
            return self._exits.get(pid)

    def close(self) -> None:
        """Tell it the launcher is done with it (``CLOSE_MESSAGE``), then close its socket: it ends any
        supervisor still below it, which no launcher knows of (see ``host.zygote._end_orphans``),
        and exits. Only this orderly close does that: a socket that merely closes (the notebook
        died, or a detached session's launcher was dropped) leaves the supervisors to themselves."""
        self._closed = True
        try:  # not under the lock: a fork that an interrupted start left waiting may hold it
            self._sock.send(CLOSE_MESSAGE)  # (one datagram: never interleaved with another thread's)
            # that fork's wait (jupyter_client's start runs in its own thread) reads the end of the
            # socket at once, rather than a descriptor closed under it (EBADF, logged as an error)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # it is gone already
            pass
        self._sock.close()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """What jupyter_client's provisioner needs of a process (Popen's poll, wait, signals) for a
    supervisor that is the zygote's child. Signals go through a pidfd where there is one, so a
    reused pid is never signalled."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote
        #: held to close the pidfd and to signal through it (other threads poll and signal the
        #: same process: a signal must never reach whatever reuses the closed descriptor)
        self._close_lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def poll(self) -> int | None:
        """Popen's: the exit status once the zygote reported it. While the pidfd says the
        supervisor runs, the zygote is not asked: the dead-or-busy check before every cell asks
        every rank, and a look at the pidfd (under 1 us) is what a non-blocking ``recv`` on the
        zygote's socket under its lock was not (about 4 us a rank a cell, issue 39's profile).
        Without a pidfd the zygote is asked every time (a pid alone can be reused). Any thread
        may call it (an interrupt asks whether the rank is alive from its own)."""
        if self.returncode is None and self._pidfd_exited() is not False:
            returncode = self._zygote.returncode(self.pid)
            if returncode is None and self._zygote.gone and not self._running():
                # its zygote died before it, so nobody collected its status: reported as a SIGKILL
                returncode = -signal.SIGKILL
            if returncode is not None:
                self.returncode = returncode
                with self._close_lock:  # (a signal sent meanwhile holds it: never to a reused number)
                    pidfd, self._pidfd = self._pidfd, None
                    if pidfd is not None:
                        os.close(pidfd)
        return self.returncode

    def __del__(self) -> None:
        """A handle let go before its exit status came (the session ended while the zygote had not
        yet reported it, or ended first) gives its pidfd back: nothing else would close it, and
        every session left one or two open in the notebook's process. Nothing else holds the
        handle any more, so no thread polls or signals through the descriptor meanwhile."""
        pidfd, self._pidfd = getattr(self, "_pidfd", None), None
        if pidfd is not None:
            os.close(pidfd)

    @property
    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable once the process has exited (its pidfd), to look at
        many at once (:meth:`~clorch_repl.launchers.local.LocalLauncher.dead`); None once the exit
        status is known, or without a pidfd. The pidfd is closed only after :attr:`returncode` is
        set: a caller that found it quiet and then finds ``returncode`` still None saw this process."""
        return self._pidfd if self.returncode is None else None

    def _pidfd_exited(self) -> bool | None:
        """Whether the pidfd says the supervisor exited; None without one (or once it is closed)."""
        pidfd = self._pidfd
        if pidfd is None:
            return None
        try:  # select, not a shared select.poll object: two threads may ask at once
            return bool(select.select([pidfd], [], [], 0)[0])  # readable once it has exited
        except (OSError, ValueError):  # closed by another thread's poll meanwhile
            return None

    def _running(self) -> bool:
        exited = self._pidfd_exited()
        if exited is not None:
            return not exited
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is not None:
            return
        with self._close_lock:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)
                return
            if self.returncode is not None:  # it exited, and another thread closed the pidfd
                return
        os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProvisioner(LocalProvisioner):  # type: ignore[misc]
    """jupyter_client's local provisioner, but the process comes from the launcher's zygote."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
        zygote: Zygote = kwargs.pop(ZYGOTE_KW)
        cwd = kwargs.get("cwd") or workdir.working_directory()
        self.process = zygote.fork(cmd, dict(kwargs["env"]), cwd, kwargs["stdout"])
        self.pid = self.process.pid
        # its own session (setsid in the child), perhaps not yet: never ask getpgid, which could
        # still name the zygote's group, and an interrupt would then reach the zygote
        self.pgid = self.pid
        self.cwd = cwd
        return self.connection_info


class Zygotes:
    """A launcher's zygote, started at its first fork, and those it replaced (stale ones are kept,
    forking nothing more, until no supervisor of theirs is left: their exit would end those ranks)."""

    def __init__(self, session_dir: str) -> None:
        self.dir = session_dir
        self.current: Zygote | None = None
        self._retired: list[Zygote] = []
        #: why forking failed, once it did: this launcher's ranks are fresh interpreters from then on
        self.broken = ""

    def get(self) -> Zygote | None:
        """The zygote to fork from now (a fresh one where the last is stale); None when forking failed."""
        if self.broken:
            return None
        self._retired = [z for z in self._retired if not _closed_if_idle(z)]
        if self.current is not None and self.current.stale():
            logger.info("clorch_repl: the environment or working directory changed; a new rank zygote starts")
            self._retired.append(self.current)
            self.current = None
        if self.current is None:
            if not provisioner_registered():  # asked once a zygote, not once a rank (about 5 ms each)
                self.broken = (f"the kernel provisioner {PROVISIONER!r} is not registered: clorch_repl is on "
                               "the path but not pip-installed (`pip install -e .` in its checkout forks the "
                               "ranks, a faster start)")
                logger.info("clorch_repl: %s; starting the ranks as fresh interpreters", self.broken)
                return None
            self.current = Zygote(os.path.join(self.dir, "zygote.log"))
        return self.current

    def close(self) -> None:
        """End every zygote (the launcher has ended their ranks first)."""
        zygotes, self._retired = [*self._retired, *([self.current] if self.current else [])], []
        self.current = None
        for zygote in zygotes:
            zygote.close()


def _closed_if_idle(zygote: Zygote) -> bool:
    if not zygote.gone and any(zygote.returncode(pid) is None for pid in zygote.forked):
        return False
    zygote.close()
    return True


def start_kernel(zygotes: Zygotes, manager_for: Callable[[bool], Any], **kwargs: Any) -> Any:
    """Start a rank's kernel (``manager_for(forked)`` makes its ``KernelManager``): forked from the
    zygote where wanted, as a fresh interpreter where not, or where the zygote failed (said once,
    in the log: the rank's own start then shows what is wrong, e.g. a torch that cannot import)."""
    zygote = zygotes.get() if wanted() else None
    if zygote is not None:
        manager = manager_for(True)
        try:
            manager.start_kernel(**kwargs, **{ZYGOTE_KW: zygote})
            return manager
        except (ZygoteError, NoSuchKernel) as exc:  # NoSuchKernel: the provisioner's entry point unknown
            zygotes.broken = str(exc)  # (clorch_repl installed anew under a running notebook)
            logger.warning("clorch_repl: %s; starting the ranks as fresh interpreters", exc)
            manager.cleanup_resources()
    manager = manager_for(False)
    manager.start_kernel(**kwargs)
    return manager
