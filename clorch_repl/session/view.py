"""A read-only view of a session: the facts its readers show, taken at one moment.

Why: ``%clorch status``, ``%clorch top`` (:mod:`.panel`) and the magics each read the session's
launcher, relay, cell records and lifecycle themselves, so each knew how a rank's state is worked
out (dead, starting, busy, idle) and which of the session's fields hold what; a new state of the
session (recovering, suspended, detached) had to be taught to every one of them. A
:class:`SessionView` is made by the session alone (:meth:`Session.view`) from what it owns, and is
plain frozen data: a reader can keep it, compare it and render it, and cannot change the session
through it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from .cell_labels import RankCells
from .lifecycle import Lifecycle, SessionState
from .protocol import RankState

if TYPE_CHECKING:
    from ..launchers.base import Launcher
    from ..common.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["RankView", "SessionView", "not_running_view", "session_view"]


@dataclass(frozen=True)
class RankView:
    """One rank as its readers see it."""

    rank: int
    #: the host it runs on ("" for the notebook's own)
    host: str
    state: RankState
    #: why its process is not running ("exit code 3", "lost: ..."), None while it runs
    exit: str | None
    pid: int | None
    #: the device it was given ("cuda:1", "cpu")
    device: str
    #: time.time() when its current process started
    started_at: float
    #: the label of the cell it runs (``[5] first line``) and time.monotonic() when that was sent;
    #: None when it runs none (also a stuck rank's cell, whose wait ended, is shown)
    cell: tuple[str, float] | None = None
    #: the last line of its log (only when the view was asked for them, only for this host's ranks)
    last_line: str | None = None

    @property
    def alive(self) -> bool:
        return self.state is not RankState.DEAD

    @property
    def busy(self) -> bool:
        return self.state is RankState.BUSY


@dataclass(frozen=True)
class SessionView:
    """The session at one moment (see the module docstring)."""

    state: SessionState
    #: why the state is what it is, for the user; "" when plain
    why: str
    #: how often the group was formed again in place (0 after each start)
    generation: int
    #: the launcher's name (``local``, ``slurm``, ...)
    launcher: str
    backend: str
    ranks: tuple[RankView, ...]
    #: time.time() when the group was formed; None while it starts
    started_at: float | None

    @property
    def hosts(self) -> dict[int, str]:
        """rank -> host for ranks on other hosts (empty when every rank runs on this one)."""
        return {r.rank: r.host for r in self.ranks if r.host}

    @property
    def alive(self) -> list[int]:
        return [r.rank for r in self.ranks if r.alive]


def session_view(launcher: Launcher, busy: Iterable[int], life: Lifecycle, cells: RankCells, topology: Topology, *,
                 generation: int, started_at: float | None, last_lines: bool = False) -> SessionView:
    """The view of a session's ranks under ``launcher`` (``busy``: ranks running a request, as the
    relay says). ``last_lines`` reads each of this host's live ranks' log for its last line (file
    reads: only the panel asks)."""
    busy = set(busy)
    starting = started_at is None
    ranks = []
    for proc in launcher.ranks:
        alive = proc.alive
        if not alive:
            state = RankState.DEAD
        elif starting:
            state = RankState.STARTING
        else:
            state = RankState.BUSY if proc.rank in busy else RankState.IDLE
        ranks.append(RankView(
            rank=proc.rank, host=proc.host, state=state, exit=proc.exit, pid=proc.pid,
            device=topology.device_label(proc.rank), started_at=proc.started_at,
            cell=cells.of(proc.rank, busy) if alive else None,
            last_line=_last_line(launcher, proc.rank) if last_lines and alive and not proc.host else None))
    return SessionView(state=life.state, why=life.why, generation=generation, launcher=launcher.name,
                       backend=topology.backend, ranks=tuple(ranks), started_at=started_at)


def not_running_view(life: Lifecycle, topology: Topology, launcher: str) -> SessionView:
    """The view of a session without ranks (before its first start, after a stop): its state
    (``stopped``; ``starting`` while a start launches them), and no rank; ``launcher``: the name
    of the launcher its start uses ("" where the session's factory has none)."""
    return SessionView(state=life.state, why=life.why, generation=0, launcher=launcher, backend=topology.backend,
                       ranks=(), started_at=None)


def _last_line(launcher: Launcher, rank: int) -> str | None:
    """The last line ``rank``'s current process wrote to its log (not the start banner), or None."""
    try:
        tail = launcher.current_log_tail(rank, 1)
    except (OSError, ValueError) as exc:
        logger.debug("no log tail of rank %d: %s", rank, exc)
        return None
    return tail.strip().splitlines()[-1] if tail.strip() else None


def uptime_s(rank: RankView, now: float | None = None) -> float:
    """How long ``rank``'s current process has run (0 for a dead one)."""
    return (time.time() if now is None else now) - rank.started_at if rank.alive else 0.0
