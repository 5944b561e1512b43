"""One rank's process below its supervisor: started, watched, interrupted and ended one way.

A multi-host rank's nanny (:mod:`clorch_repl.host.nanny`, its kernel and warm spare) and a batch job
(:mod:`clorch_repl.jobs.job_ranks`, one process per rank) both start a command below a
:mod:`.supervisor` and later ask the same things of it; this is the one place that knows how, as
torch elastic's ``PContext`` serves every kind of worker. (The ``local`` launcher's ranks are
started by jupyter_client's ``KernelManager`` from a kernelspec whose command is the same
:func:`.supervisor.command`, and ended with the same :data:`.supervisor.STOP_GRACE_S`.)

The process the caller holds is the supervisor: it mirrors the rank's exit status, forwards
SIGUSR1 (stack dumps) to the rank, and on SIGTERM ends the rank and everything it started within
its ``--grace``. The rank's own pid is known once the supervisor has written its pid file.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Mapping

from ..common.procs import describe_exit
from ..placement import teardown
from . import supervisor

logger = logging.getLogger(__name__)


class RankProcess:
    """A command running below its supervisor (see the module docstring)."""

    def __init__(self, child: subprocess.Popen[bytes], pid_file: str) -> None:
        self.child = child
        self.pid_file = pid_file

    @classmethod
    def spawn(cls, argv: list[str], *, env: Mapping[str, str], log_fd: int, pid_file: str,
              grace_s: float = supervisor.STOP_GRACE_S, session_dir: str | None = None,
              cwd: str | None = None) -> RankProcess:
        """Start ``argv`` below a supervisor that watches this process, stdout and stderr to
        ``log_fd`` (closed here, started or not).

        The supervisor gets a session and process group of its own, which the rank shares: an
        interrupt (SIGINT to that group) reaches this rank only, and nothing sent to the caller's
        group (Slurm's task group, a terminal's Ctrl-C) reaches it. ``session_dir`` is removed by
        the supervisor when this process dies first (give it only for a directory nobody else
        reads). Raises OSError when the process cannot be started."""
        cmd = supervisor.command(sys.executable, grace_s, os.getpid(), argv, pid_file=pid_file,
                                 session_dir=session_dir)
        try:
            child = subprocess.Popen(cmd, env=dict(env), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                     cwd=cwd, start_new_session=True, close_fds=True)
        finally:
            os.close(log_fd)
        return cls(child, pid_file)

    @property
    def supervisor_pid(self) -> int:
        return self.child.pid

    @property
    def rank_pid(self) -> int | None:
        """The rank's own process, once its supervisor has written the pid file (None before)."""
        return supervisor.read_pid(self.pid_file)

    @property
    def pid(self) -> int:
        """The rank's own process, or its supervisor until that is known (signals sent to the
        supervisor that matter, SIGUSR1 and SIGTERM, reach the rank all the same)."""
        return self.rank_pid or self.child.pid

    def poll(self) -> int | None:
        """The exit status once it has ended (negative: killed by that signal), else None."""
        return self.child.poll()

    @property
    def running(self) -> bool:
        return self.child.poll() is None

    @property
    def exit(self) -> str | None:
        """None while it runs; "exit code 3", "killed by signal SIGKILL" once it has ended."""
        code = self.child.poll()
        return None if code is None else describe_exit(code)

    def wait(self) -> int:
        """Block until it has ended; its exit status."""
        return self.child.wait()

    def interrupt(self) -> None:
        """KeyboardInterrupt in the rank's running code: SIGINT to its process group (the
        supervisor blocks SIGINT; the rank receives it)."""
        if self.running and not teardown.interrupt(self.child.pid):
            logger.debug("pid %d ended before its interrupt", self.child.pid)

    def end(self, grace_s: float = supervisor.STOP_GRACE_S) -> int | None:
        """End the rank and everything below it: SIGTERM to the supervisor (which passes it on and
        SIGKILLs what is left after its own grace), then SIGKILL to whatever is still there after
        ``grace_s`` and a margin: the one way every supervised rank is ended
        (:func:`clorch_repl.placement.teardown.end_supervised`). Returns the exit status."""
        child = self.child
        if child.poll() is not None:
            return child.returncode
        teardown.end_supervised([child.pid], teardown.deadline(grace_s))
        return child.wait()
