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
import time
from typing import Iterable

import psutil

from ..common.procs import kill_tree, pid_running, process_tree, signal_group, wait_gone

logger = logging.getLogger(__name__)

#: What SIGKILL waits for after a supervisor's own grace has run out: it SIGKILLs what is left of
#: its rank at that grace and exits; this second is for that to happen before we do it ourselves.
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


def deadline(grace_s: float, margin_s: float = KILL_MARGIN_S) -> float:
    """The time.monotonic() by which supervisors given ``grace_s`` should be gone."""
    return time.monotonic() + grace_s + margin_s


def outlived(pids: Iterable[int], timeout_s: float = GONE_WAIT_S) -> list[str]:
    """Wait up to ``timeout_s`` for ``pids`` (a stop's supervisors, ranks and their trees) to be
    gone; what is still running, as the lines a stop reports (should be none), also logged."""
    left = sorted(set(wait_gone(pids, timeout_s=timeout_s)))
    if left:
        logger.warning("clorch_repl: processes %s of the ranks outlived the stop", left)
    return [f"process {pid} (sent SIGKILL)" for pid in left]


def interrupt(supervisor: int) -> bool:
    """KeyboardInterrupt in a rank's running code: SIGINT to its supervisor's process group (the
    supervisor leads it and blocks SIGINT; the rank and its children get it, as from
    jupyter_client's interrupt). False when the group is gone."""
    return signal_group(supervisor, signal.SIGINT)
