"""Ending ranks that run below their supervisors on this host: the one way, for every caller.

A session's local ranks and warm spares (:mod:`clorch_repl.launchers.local`), a detached
session's ranks (:mod:`clorch_repl.launchers.adopted`), a batch job's local ranks
(:mod:`clorch_repl.jobs.job_ranks`) and a nanny's kernel (:mod:`clorch_repl.host.rank_process`)
are each a supervisor (:mod:`clorch_repl.host.supervisor`) with the rank below it. Each is ended
the same way: SIGTERM to every supervisor at once (it passes it on, and SIGKILLs its rank's whole
tree after its own grace), one shared deadline, then SIGKILL to the supervisor's process group and
to whatever is left of the trees read before anything was re-parented, then a wait for all of it
to be gone. Only pids and process groups we started are signalled, never a name.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Iterable

import psutil

from ..common.procs import kill_tree, pid_running, process_tree, signal_group, wait_gone

logger = logging.getLogger(__name__)

#: What SIGKILL waits for after a supervisor's own grace has run out: it SIGKILLs what is left of
#: its rank at that grace and exits; this second is for that to happen before we do it ourselves.
#: The one margin of every caller (:func:`deadline`, counted from the SIGTERM): the local
#: launcher's and a detached session's stops once gave half a second, counted by the local one
#: from before its polite shutdown request, so a slow request cut a rank's SIGTERM grace short.
KILL_MARGIN_S = 1.0
#: How long the processes of ended ranks get to be gone after their SIGKILL before they are
#: named as having outlived the stop.
GONE_WAIT_S = 2.0


def end_supervised(supervisors: list[int], deadline: float) -> list[psutil.Process]:
    """End ranks through their supervisors: SIGTERM to each one still running (it ends its rank
    and all it started, with its own grace, then SIGKILL), wait for them until ``deadline``
    (time.monotonic()), then SIGKILL whatever of their trees is left. Returns every process that
    was in those trees, for the caller to wait on (:func:`outlived`). The trees are read first,
    before anything is re-parented."""
    trees = {pid: process_tree(pid) for pid in supervisors}
    for pid in supervisors:
        if pid_running(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                logger.debug("supervisor %d ended before its SIGTERM", pid)
    late = wait_gone(supervisors, timeout_s=max(0.0, deadline - time.monotonic()))
    if late:
        logger.info("clorch_repl: supervisors %s outlived their stop; SIGKILL to them and everything below them",
                    late)
    for pid, tree in trees.items():
        kill_tree(pid, tree)
    return [p for tree in trees.values() for p in tree]


def deadline(grace_s: float) -> float:
    """The time.monotonic() by which supervisors given ``grace_s`` from now (their SIGTERM) should
    be gone: the one shared deadline of :func:`end_supervised`'s callers."""
    return time.monotonic() + grace_s + KILL_MARGIN_S


def outlived(pids: Iterable[int], timeout_s: float = GONE_WAIT_S) -> list[str]:
    """Wait up to ``timeout_s`` for ``pids`` (a stop's supervisors, ranks and their trees) to be
    gone; what is still running, as the lines a stop reports (should be none), also logged."""
    left = sorted(set(wait_gone(pids, timeout_s=timeout_s)))
    if left:
        logger.warning("clorch_repl: processes %s of the ranks outlived the stop", left)
    return [outlived_line(pid, _name(pid), socket.gethostname()) for pid in left]


def outlived_line(pid: int, name: str | None, host: str) -> str:
    """What a stop says of a process still there after its SIGKILL: which one, where, and what
    to do (it may be in uninterruptible sleep, e.g. a hung GPU driver call or NFS, and go later)."""
    what = f"process {pid}" + (f" ({name})" if name else "")
    return (f"{what} on {host} was sent SIGKILL and is still there: check it with `ps -p {pid} -o pid,stat,cmd` "
            f"on {host} and, if it is still there, end it with `kill -9 {pid}` (state D: it waits on the "
            "kernel, a GPU driver or a filesystem, and goes when that returns)")


def _name(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def interrupt(supervisor: int) -> bool:
    """KeyboardInterrupt in a rank's running code: SIGINT to its supervisor's process group (the
    supervisor leads it and blocks SIGINT; the rank and its children get it, as from
    jupyter_client's interrupt). False when the group is gone."""
    return signal_group(supervisor, signal.SIGINT)
