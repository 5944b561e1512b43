"""What crosses the boundary between the notebook and its ranks, named before it moves.

The relay (:mod:`.relay`) turns the Jupyter messages of N worker kernels into these values; the
display (:mod:`.display`) turns them into notebook output; the magics only see outcomes. Keeping
the three apart is what lets the relay be tested without a notebook and the display without ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..wire.limits import Limits


class RankState(str, enum.Enum):
    """Life of one rank as the notebook sees it."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


@dataclass(frozen=True)
class CellRequest:
    """One ``%%distributed`` cell: the code, the ranks that run it, and an optional time limit."""

    code: str
    ranks: tuple[int, ...]
    timeout_s: float | None = None
    #: seconds without output and without a finished collective before the cell says why it is
    #: stuck (once, without stopping it); 0 turns the notice off
    hang_notice_s: float = 0.0
    #: ranks whose input() / breakpoint() prompts reach the front end (None: every rank); the
    #: others raise StdinNotImplementedError naming ``--stdin-ranks``
    stdin_ranks: tuple[int, ...] | None = None
    #: what a rank left out of ``stdin_ranks`` says when it asks (the driver's ``Verbs.stdin_refused``)
    stdin_refused: str = ""
    #: the number the notebook shows for this cell (``[12]``): each rank numbers its run of the
    #: cell the same, so that its traceback says ``Cell In[12]``; None leaves the ranks' own count
    cell_number: int | None = None
    #: each rank's output budget for the cell (clorch_repl.wire.limits); None: the rank's defaults
    output_limits: Limits | None = None
    #: a user's cell: a rank that an interrupt does not free because it waits in a collective is
    #: freed by aborting the session's group (see cell_run.FreeGroup); clorch's own requests never
    recover: bool = False


@dataclass(frozen=True)
class RankOutput:
    """One piece of output from one rank, in the order the rank produced it.

    ``kind`` is the Jupyter message type it came from: ``stream`` (``content`` has ``name`` and
    ``text``), ``display_data``, ``update_display_data``, ``execute_result`` (``data``,
    ``metadata``, ``transient``) or ``clear_output`` (``wait``).
    """

    rank: int
    kind: str
    content: dict[str, Any]


@dataclass(frozen=True)
class RankError:
    """An exception raised by user code on one rank."""

    rank: int
    ename: str
    evalue: str
    traceback: tuple[str, ...]


class Status(str, enum.Enum):
    """How one rank's part of a cell ended."""

    OK = "ok"
    ERROR = "error"          # the code raised; see RankOutcome.error
    DIED = "died"            # the process ended; see RankOutcome.exit
    INTERRUPTED = "interrupted"  # KeyboardInterrupt reached the rank's code
    STUCK = "stuck"          # did not return within the grace period after an interrupt
    #: returned after an interrupt (its probe or its stack shows it idle in its event loop), but
    #: its reply had not been read when the wait ended: neither stuck nor known to have failed
    RETURNED = "returned"


@dataclass
class RankOutcome:
    """The end of one rank's part of a cell."""

    rank: int
    status: Status = Status.OK
    error: RankError | None = None
    exit: str | None = None      # "killed by signal SIGKILL", "exit code 3"
    stack: str | None = None     # where a stuck rank is, from its faulthandler dump
    log_tail: str | None = None  # the end of a dead rank's log (a segfault's message lives there)
    #: the rank waited in a collective and was freed by the abort of the session's group; what it
    #: raised then is the abort's doing, not its code's
    freed: bool = False
    #: at the last check whether the group could be aborted, the rank was still in the cell but not
    #: waiting in a collective (its own code, native code, or no answer): where ranks waiting in a
    #: collective may be waiting for it, it is the one to restart
    outside_collective: bool = False
    #: the rank was sent an interrupt (the user's, the time limit's, or after another rank failed)
    #: while its part ran: what it raised or how it died afterwards may be the interrupt's doing
    #: (a KeyboardInterrupt in the middle of torch's import can leave a process that segfaults)
    interrupted: bool = False


@dataclass
class CellOutcome:
    """The end of one cell on every rank it ran on, plus why the wait ended early, if it did."""

    ranks: dict[int, RankOutcome] = field(default_factory=dict)
    interrupted: bool = False
    timed_out: bool = False
    #: why ranks were stuck, when they were: the verdict sentence, then each rank's evidence
    diagnosis: str | None = None
    #: the verdict the live hang notice already printed into the cell (the report does not repeat it)
    noticed: str | None = None
    #: how long interrupted ranks were given to return before they were reported stuck
    interrupt_grace_s: float = 0.0
    #: an interrupt from the notebook ended the wait at once, before that grace was over (a
    #: second one, or one during the grace that a timeout or a death had started)
    cut_short: bool = False
    #: the session's group was aborted to free ranks waiting in a collective (cell_run.FreeGroup)
    group_aborted: bool = False
    #: when (time.monotonic()) it was aborted
    aborted_at: float | None = None
    #: what the session did about it afterwards, one line (the group formed again, or why not)
    recovery: str | None = None
    #: how many ranks the session has (0: not known), so that a report advising a restart of some
    #: ranks can tell when they are all of them
    world_size: int = 0
    #: for dead or stuck ranks, what the report advises where the session's launcher cannot start
    #: them again alone (a detached session: Launcher.instead_of_replacing); "" where it can
    instead_of_replacing: str = ""

    @property
    def failed(self) -> list[RankOutcome]:
        return [o for o in self.ranks.values() if o.status is not Status.OK]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted and not self.timed_out

    @property
    def ended_by_user(self) -> bool:
        """The user's interrupt ended the cell, and no rank had failed before it was interrupted:
        what the ranks raised or how they died after the interrupt reached them is its doing, not a
        failure of their own to report (a start the user interrupts says so, not "rank 3 died")."""
        return self.interrupted and not any(
            o.status in (Status.ERROR, Status.DIED) and not o.interrupted for o in self.ranks.values())
