"""What a session is at any moment, owned by the session alone and changed only by named moves.

Why one state rather than fields checked for None: a session now has more lives than "running or
not" (its group aborted and formed again, ranks lost and replaced, and next suspended, detached,
driven from another kernel), and each question ("may a cell run?", "what does status say?",
"may this restart take only rank 1?") must get one answer from one place. In the manner of torch
elastic's ``WorkerState``, which its agent alone changes: :class:`Lifecycle` is changed by the
session (:class:`~clorch_repl.session.session.Session`) through :meth:`Lifecycle.move` with one of
the :data:`MOVES`, each legal only from the states it lists; every other reader (status, the
panel, the magics) reads :attr:`Lifecycle.state` and :attr:`Lifecycle.why`.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class SessionState(str, enum.Enum):
    """What a session can be."""

    #: no ranks (before the first start, after a stop)
    STOPPED = "stopped"
    #: ranks starting and forming their group (a start, a restart)
    STARTING = "starting"
    #: every rank alive and in the group: cells run
    READY = "ready"
    #: the group was aborted to free ranks stuck in a collective and is being formed again
    RECOVERING = "recovering"
    #: a rank is dead or stuck: the others keep their state and run cells without a group until
    #: ``%clorch restart --ranks`` replaces it
    DEGRADED = "degraded"
    #: the ranks are being ended
    STOPPING = "stopping"


S = SessionState
#: move -> (the states it is legal from, the state it leads to)
MOVES: dict[str, tuple[frozenset[SessionState], SessionState]] = {
    "start": (frozenset({S.STOPPED}), S.STARTING),
    "formed": (frozenset({S.STARTING, S.RECOVERING}), S.READY),
    "abort": (frozenset({S.READY, S.DEGRADED}), S.RECOVERING),
    "degrade": (frozenset({S.READY, S.RECOVERING, S.STARTING}), S.DEGRADED),
    "replace": (frozenset({S.DEGRADED}), S.RECOVERING),
    "stop": (frozenset(set(S) - {S.STOPPED}), S.STOPPING),
    "stopped": (frozenset({S.STOPPING, S.STARTING}), S.STOPPED),
}


class IllegalMove(RuntimeError):
    """A move asked of a state it is not legal from: a bug in clorch_repl, never the user's."""


@dataclass
class Lifecycle:
    """The state of one session (see the module docstring)."""

    state: SessionState = SessionState.STOPPED
    #: why the state is what it is, for the user ("rank 1 died (exit code 3)"); "" when plain
    why: str = ""
    #: time.monotonic() of the last move
    since: float = field(default_factory=time.monotonic)

    def move(self, name: str, why: str = "") -> SessionState:
        """Make the move ``name`` (one of :data:`MOVES`); returns the new state."""
        sources, target = MOVES[name]
        if self.state not in sources:
            raise IllegalMove(f"clorch_repl: a session cannot {name} while {self.state.value}")
        logger.info("clorch_repl: session %s -> %s (%s)%s", self.state.value, target.value, name,
                    f": {why}" if why else "")
        self.state, self.why, self.since = target, why, time.monotonic()
        return target

    def move_if(self, name: str, why: str = "") -> bool:
        """Make the move ``name`` where it is legal now (a stop, which may find the session
        stopped already); whether it was made."""
        if not self.can(name):
            return False
        self.move(name, why)
        return True

    def can(self, name: str) -> bool:
        """Whether the move ``name`` is legal now."""
        return self.state in MOVES[name][0]

    @property
    def running(self) -> bool:
        """Whether there are ranks to talk to (cells, status, logs)."""
        return self.state in (S.READY, S.RECOVERING, S.DEGRADED)
