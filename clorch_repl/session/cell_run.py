"""One cell on its ranks as a pure state machine: when each rank's part is over, and what to do.

Why pure: when a cell counts as finished is the hardest logic of the notebook side (lost idle
messages, floods that drop iopub messages, interrupts, deaths, time limits), and while it lived
in the relay next to the sockets it could only be tested with real kernels. Here it is fed
events (a rank's reply, a counted iopub message, a death, the time) and answers what the relay
must do next (:class:`Interrupt`, :class:`GiveUp`) and whether the cell is :attr:`CellRun.over`;
it never reads a socket, a clock or a process. :mod:`.ledger` routes each message here, and
:mod:`.relay` does the I/O the answers ask for.

A rank's part of a cell ends once its execute_reply (shell) and every iopub message the reply
counts (wire.IOPUB_COUNT_KEY) have been read, or on its idle status (a request ipykernel's own
path answered); failing both, once the reply has come, when nothing more of the cell arrived from
it for :data:`REPLY_QUIET_S`: iopub drops messages past ZeroMQ's high-water mark, while the shell
reply is never dropped. The quiet period is generous because a rank's display output leaves
through its IOPub thread, which a loaded machine can hold back behind the reply: a short one
would drop the end of a cell that succeeded. It costs nothing when every counted message arrives.

Output the notebook's guard (flood_guard.backstop) holds back is counted per rank and announced once,
at the cell's end (:meth:`CellRun.withheld_lines`). The rule for late output: whatever reaches
the notebook while a cell runs, of that cell or of an earlier one (a thread it left printing),
passes the running cell's guard and is counted there; a rank's own budget, kept after its cell
for such a thread, announces what it held back after its cell's line at the start of the next
cell (kernel/output.py), so nothing is held back without a line saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..wire import limits as flood
from . import cell_end, flood_guard
from .protocol import CellOutcome, CellRequest, RankError, RankOutcome, RankOutput, Status

logger = logging.getLogger(__name__)

#: Message types forwarded to the display as they arrive.
OUTPUT_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result", "clear_output"})
#: How long ranks get to return after an interrupt before they are reported stuck.
INTERRUPT_GRACE_S = 5.0
#: After a rank dies or raises mid-cell, how long the others may finish on their own before they
#: are interrupted: in SPMD code they are most likely waiting for it in a collective, which would
#: otherwise hold them until the process group's timeout (torchelastic stops the rest likewise).
FAILURE_GRACE_S = 2.0
#: See the module docstring: after the reply, how long a rank may be silent before its part ends.
REPLY_QUIET_S = 3.0
#: A cell cut short (time limit, interrupt) is not drained further: it ends this long after the
#: reply, whatever is still queued (its later output is dropped and counted, see ledger.py).
REPLY_DRAIN_S = 0.5
#: The drain after a reply never lasts longer than this, even while output keeps coming (a
#: thread the cell started, printing under the cell's header, after a lost idle status).
REPLY_DRAIN_MAX_S = 10.0
#: After an interrupt, how long ranks get before those still running are asked whether they wait
#: in a collective (Python returns from a KeyboardInterrupt within milliseconds; a collective
#: that is about to complete gets this long to do so); asked again as often until the grace ends
#: while some rank is still elsewhere (a loaded machine's rank still unwinding its interrupt).
GROUP_CHECK_S = 0.5
#: After the session's group was aborted, how long the ranks it freed get to return.
ABORT_GRACE_S = 3.0


@dataclass(frozen=True)
class Interrupt:
    """Interrupt ``ranks`` (maybe none: the grace period starts anyway); ``diagnose``: first ask
    every rank where it is (before the interrupt moves anything) and hand the text to
    :meth:`CellRun.diagnosed`. Then :meth:`CellRun.interrupted`."""

    ranks: tuple[int, ...]
    diagnose: bool


@dataclass(frozen=True)
class GiveUp:
    """Stop waiting for ``ranks``: find each one's evidence (its probe answer and stack, unless
    ``hurry``) and hand it to :meth:`CellRun.gave_up`; ``diagnose``: the report needs a diagnosis."""

    ranks: tuple[int, ...]
    hurry: bool
    diagnose: bool


@dataclass(frozen=True)
class FreeGroup:
    """``ranks`` still run the cell after an interrupt: ask each whether it waits in a collective
    (cell_end.waits_in_group); if every one does, abort the session's group on every live rank,
    which makes those calls raise. Then :meth:`CellRun.group_checked`."""

    ranks: tuple[int, ...]


Command = Interrupt | GiveUp | FreeGroup


@dataclass
class CellRun:
    """Book-keeping and policy of one cell while its ranks run (see the module docstring).

    ``running`` is the relay's map of the request each rank is executing (shared, see
    :class:`~clorch_repl.session.ledger.Ledger`): a rank whose part ends here is freed there."""

    request: CellRequest
    now: float
    running: dict[int, str | None] = field(default_factory=dict)
    interrupt_grace_s: float = INTERRUPT_GRACE_S
    msg_ids: dict[int, str] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    outcome: CellOutcome = field(default_factory=CellOutcome)
    deadline: float | None = None          # the cell's own time limit
    give_up_at: float | None = None        # end of the grace period after an interrupt
    failed_at: float | None = None         # when the first rank died or raised
    group_check_at: float | None = None    # when to ask the ranks still running about the group
    last_progress: float = 0.0             # last output of any rank (the hang watch reads it)
    diagnosis: str | None = None           # taken before the first interrupt, for the report
    hurry: bool = False                    # interrupted twice: ask the ranks nothing more
    replied_at: dict[int, float] = field(default_factory=dict)  # execute_reply arrival, per rank
    #: ranks whose end of the cell was confirmed: their reply and every iopub message it counts
    #: read (wire.IOPUB_COUNT_KEY), or their idle status
    finished: set[int] = field(default_factory=set)
    expected: dict[int, int] = field(default_factory=dict)  # iopub messages the reply counted, per rank
    received: dict[int, int] = field(default_factory=dict)  # counted iopub messages read, per rank
    heard: dict[int, float] = field(default_factory=dict)  # last iopub message of the cell, per rank
    #: the notebook's own guard on what each rank's output of the cell forwards (flood_guard.backstop)
    guard_limits: flood.Limits = field(default_factory=flood.Limits)
    guards: dict[int, flood.Budget] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ranks = self.request.ranks
        self.outcome = CellOutcome(ranks={r: RankOutcome(r) for r in ranks}, interrupt_grace_s=self.interrupt_grace_s)
        self.pending = set(ranks)
        self.last_progress = self.now
        if self.request.timeout_s is not None:
            self.deadline = self.now + self.request.timeout_s
        self.guard_limits = flood_guard.backstop(self.request.output_limits)

    # ------------------------------------------------------------------------------ events
    def sent(self, rank: int, msg_id: str) -> None:
        """The cell's request went to ``rank`` as ``msg_id``."""
        self.msg_ids[rank] = msg_id
        self.running[rank] = msg_id

    @property
    def over(self) -> bool:
        """Whether no rank is waited for any more (the wait ends; see :meth:`Ledger.end`)."""
        return not self.pending

    def mine(self, rank: int, parent_id: str | None) -> bool:
        return parent_id is not None and self.msg_ids.get(rank) == parent_id

    def output(self, rank: int, kind: str, content: dict[str, Any], parent_id: str | None,
               now: float) -> RankOutput | None:
        """An output message of ``rank`` (of this cell, or a thread of an earlier one that ended
        normally): what to show, or None when the guard holds it back (counted for the line)."""
        self.last_progress = now
        guard = self.guards.get(rank)
        if guard is None:
            guard = self.guards[rank] = flood.Budget(self.guard_limits, now)
        if kind == "clear_output" or guard.admit_size(*flood_guard.message_size(kind, content), now):
            return RankOutput(rank, kind, content)
        return None

    def heard_from(self, rank: int, parent_id: str | None, now: float) -> None:
        """Any iopub message of the cell from ``rank``: its quiet period starts again."""
        if self.mine(rank, parent_id):
            self.heard[rank] = now

    def error(self, rank: int, content: dict[str, Any], now: float) -> None:
        """The rank's code raised (its iopub error, or its reply's error content)."""
        result = self.outcome.ranks[rank]
        result.error = RankError(rank, content.get("ename", ""), content.get("evalue", ""),
                                 tuple(content.get("traceback", ())))
        result.status = Status.INTERRUPTED if result.error.ename == "KeyboardInterrupt" else Status.ERROR
        if result.status is Status.ERROR and self.failed_at is None:
            self.failed_at = now

    def counted(self, rank: int, parent_id: str | None) -> bool:
        """A message the rank counted (wire.COUNTED_KEY): True when it is of this cell (counted
        against its reply's count, which ends the rank's part once reached)."""
        if not self.mine(rank, parent_id):
            return False
        self.received[rank] = got = self.received.get(rank, 0) + 1
        if rank in self.pending and got >= self.expected.get(rank, got + 1):
            self._finished(rank)
        return True

    def idle(self, rank: int, parent_id: str | None) -> bool:
        """The rank's idle status: True (its part is over) when it is of this cell."""
        if not self.mine(rank, parent_id):
            return False
        self._finished(rank)
        return True

    def reply(self, rank: int, parent_id: str | None, count: int | None, content: dict[str, Any],
              now: float) -> bool:
        """The rank's execute_reply, counting ``count`` iopub messages (None: ipykernel's own
        path answered, whose idle status ends the part). True when it is of this cell and the
        rank is still waited for (otherwise the ledger books it as any other request's)."""
        if not self.mine(rank, parent_id):
            return False
        if count is not None:
            self.expected[rank] = count  # also for a rank no longer waited for: see Ledger.end
        if rank not in self.pending:
            return False
        self.replied_at.setdefault(rank, now)
        if content.get("status") == "error" and self.outcome.ranks[rank].error is None:
            self.error(rank, content, now)
        if count is not None and self.received.get(rank, 0) >= count:
            self._finished(rank)
        return True

    def died(self, rank: int, exit: str | None, host: str, log_tail: str, now: float) -> bool:
        """``rank``'s process is gone. True when the others should be diagnosed now (they most
        likely wait for it: say so while they still do), see :meth:`death_diagnosed`."""
        result = self.outcome.ranks[rank]
        result.status = Status.DIED
        result.exit = exit if not host or host in (exit or "") else f"{exit}, on {host}"
        result.log_tail = log_tail
        self.pending.discard(rank)
        self.running[rank] = None
        if self.failed_at is None:
            self.failed_at = now
            return bool(self.pending) and self.outcome.diagnosis is None
        # Another rank failed first, but so shortly before this death was seen (liveness is checked
        # every few tenths of a second) that the death most likely caused it: gloo fails a
        # survivor's collective as soon as the dead rank's sockets close. Where the others were
        # then says why, once; a failure well before the death has had its own diagnosis.
        caused = now - self.failed_at < FAILURE_GRACE_S and self.diagnosis is None
        others_failed = any(o.status is Status.ERROR for r, o in self.outcome.ranks.items() if r != rank)
        return caused and others_failed and self.outcome.diagnosis is None

    def death_diagnosed(self, text: str) -> None:
        self.outcome.diagnosis = self.diagnosis = text

    def raised(self) -> dict[int, tuple[str, str]]:
        """What ranks raised in this cell so far (rank -> exception name and message), for its
        diagnosis: the probe finds such a rank back at its prompt and cannot say why."""
        return {rank: (part.error.ename, part.error.evalue) for rank, part in self.outcome.ranks.items()
                if part.status is Status.ERROR and part.error is not None}

    def user_interrupt(self) -> bool:
        """Kernel > Interrupt. Returns whether it is the second (or came during a grace period):
        then the wait ends at once, asking the ranks nothing more."""
        again = self.outcome.interrupted or self.give_up_at is not None
        self.outcome.interrupted = True
        self.hurry = self.hurry or again
        return again

    def hurry_up(self) -> None:
        """An interrupt landed while the ranks were being asked: ask nothing more."""
        self.hurry = True

    def answered_prompt(self, now: float) -> None:
        """A rank asked for input, or the user answered it: progress, not a hang."""
        self.last_progress = now

    # -------------------------------------------------------------------------- decisions
    def wake_at(self) -> list[float]:
        """When :meth:`next_command` or :meth:`end_drained` may have something new to say. A
        deadline already acted on is left out: waking for it again would spin the poll."""
        failure = None if self.failed_at is None or self.give_up_at is not None else self.failed_at + FAILURE_GRACE_S
        deadline = None if self.outcome.timed_out else self.deadline
        times = [t for t in (deadline, self.give_up_at, failure, self.group_check_at) if t is not None]
        # the ranks whose reply came and whose end is not confirmed: a set operation in C, not a
        # Python loop over every rank that replied, once a pass of the wait
        return times + [self.drain_end(r) for r in self.pending.intersection(self.replied_at)]

    def drain_end(self, rank: int) -> float:
        """When a rank whose reply came but whose end was not confirmed stops being waited for."""
        at = self.replied_at[rank]
        if self.give_up_at is not None:  # cut short: its backlog is not shown
            return at + REPLY_DRAIN_S
        return min(max(at, self.heard.get(rank, at)) + REPLY_QUIET_S, at + REPLY_DRAIN_MAX_S)

    def end_drained(self, now: float) -> None:
        """End the part of every rank whose reply came and whose drain is over: what it still
        sends of this cell is dropped and counted (see Ledger.end)."""
        for rank in self.pending.intersection(self.replied_at):  # (see wake_at)
            if now >= self.drain_end(rank):
                self.pending.discard(rank)
                self._free(rank)

    def next_command(self, now: float) -> Command | None:
        """What the relay must do now, if anything; asked again until None (each command is
        acknowledged through :meth:`interrupted` or :meth:`gave_up`, which changes the answer)."""
        if (self.failed_at is not None and self.pending and self.give_up_at is None
                and now - self.failed_at >= FAILURE_GRACE_S):
            return self.interrupt_command()
        if self.deadline is not None and now >= self.deadline and not self.outcome.timed_out:
            self.outcome.timed_out = True
            return self.interrupt_command()
        if self.group_check_at is not None and now >= self.group_check_at:
            self.group_check_at = None
            if self.pending and not self.hurry:
                return FreeGroup(tuple(sorted(self.pending)))
        if self.give_up_at is not None and now >= self.give_up_at and self.pending:
            return self.give_up_command()
        return None

    def interrupt_command(self) -> Interrupt:
        diagnose = self.diagnosis is None and bool(self.pending) and not self.hurry
        sent = {rank for rank in self.pending if self.outcome.ranks[rank].interrupted}
        return Interrupt(tuple(sorted(self.pending - sent)), diagnose)

    def diagnosed(self, text: str) -> None:
        """Where each rank was before the interrupt (see :class:`Interrupt`)."""
        if self.diagnosis is None:
            self.diagnosis = text

    def interrupted(self, ranks: tuple[int, ...], now: float) -> None:
        """The interrupt of :class:`Interrupt` was sent at ``now``: the grace period runs."""
        if self.outcome.timed_out and self.outcome.diagnosis is None:
            self.outcome.diagnosis = self.diagnosis
        for rank in ranks:  # (RankOutcome.interrupted: whom the interrupt reached; asked again above)
            self.outcome.ranks[rank].interrupted = True
        if self.give_up_at is None:
            self.give_up_at = now + self.interrupt_grace_s
            if self.request.recover and not self.outcome.group_aborted:
                self.group_check_at = now + min(GROUP_CHECK_S, self.interrupt_grace_s)

    def group_checked(self, aborted: bool, now: float, elsewhere: tuple[int, ...] = ()) -> None:
        """The answer to :class:`FreeGroup`: ``aborted`` when the group was aborted at ``now``; the
        ranks it freed get :data:`ABORT_GRACE_S` to return (each is marked freed: what it raises
        is the abort's doing). Not aborted: asked again after :data:`GROUP_CHECK_S` while the
        interrupt's grace lasts; ``elsewhere``, the ranks that showed no wait in a collective,
        are marked so, as of this latest check (the others may be waiting for them)."""
        for rank, part in self.outcome.ranks.items():
            part.outside_collective = rank in elsewhere
        if not aborted:
            if self.give_up_at is not None and now + GROUP_CHECK_S < self.give_up_at:
                self.group_check_at = now + GROUP_CHECK_S  # ask again: a rank may still be on its way
            return
        self.outcome.group_aborted, self.outcome.aborted_at = True, now
        if self.outcome.diagnosis is None:  # the verdict taken before the interrupt: why they were stuck
            self.outcome.diagnosis = self.diagnosis
        for rank in self.pending:
            self.outcome.ranks[rank].freed = True
        self.give_up_at = max(self.give_up_at or now, now + ABORT_GRACE_S)

    def give_up_command(self) -> GiveUp:
        need = bool(self.pending) and self.outcome.diagnosis is None and not self.hurry
        return GiveUp(tuple(sorted(self.pending)), self.hurry, need and self.diagnosis is None)

    def gave_up(self, diagnosis: str | None, answers: dict[int, dict[str, Any] | None],
                stacks: dict[int, str]) -> None:
        """Stop waiting for the ranks that did not return. One whose answer or stack shows it
        returned (its reply still on its way behind its output) is RETURNED, not stuck, and free
        for the next cell (cell_end.returned); the rest are STUCK, with their stacks."""
        if self.pending and self.outcome.diagnosis is None and not self.hurry:
            self.outcome.diagnosis = self.diagnosis or diagnosis
        self.outcome.cut_short = self.outcome.cut_short or (self.hurry and bool(self.pending))
        for rank in sorted(self.pending):
            result = self.outcome.ranks[rank]
            result.stack = "" if self.hurry else stacks.get(rank, "")
            if not self.hurry and cell_end.returned(answers.get(rank), result.stack):
                result.status, result.stack = Status.RETURNED, None
                self._free(rank)
                continue
            result.status = Status.STUCK
        self.pending.clear()

    # ----------------------------------------------------------------------------- the end
    def withheld_lines(self) -> list[RankOutput]:
        """At the cell's end: a report per rank whose output the notebook's guard held back (the
        display adds it to the line at the top of the cell's output, see flood.HELD_MIME)."""
        lines = []
        for rank, guard in sorted(self.guards.items()):
            data = flood_guard.withheld_report(rank, guard)
            if data is not None:
                lines.append(RankOutput(rank, "display_data", {"data": data, "metadata": {}}))
        return lines

    def _finished(self, rank: int) -> None:
        """``rank`` has sent all it will of the cell: its part is over."""
        self._free(rank)
        self.pending.discard(rank)
        self.finished.add(rank)

    def _free(self, rank: int) -> None:
        if self.running.get(rank) == self.msg_ids.get(rank):
            self.running[rank] = None
