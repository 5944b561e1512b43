"""The hang notice of a running cell: no output for a while and a collective pending as long.

Why apart from the relay: it is a policy of its own (when to ask, how cheaply, when to speak)
over a question that costs the ranks CPU, and it needs only three things of the relay: the time
of the cell's last progress (:attr:`CellRun.last_progress`), a way to ask the ranks
(:class:`Asker`), and the cell's sink to speak through (``notice``). It speaks at most once per
cell, and never once the cell is being interrupted (the report says why instead).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from ..diagnosis import render
from ..diagnosis.analyse import CollectiveProgress, RankEvidence, Verdict, analyse, progress
from .cell_run import CellRun
from .sink import OutputSink

logger = logging.getLogger(__name__)

#: While a collective is pending but younger than the hang notice, how often to look again.
HANG_RECHECK_S = 1.0


class Asker(Protocol):
    """What the hang watch asks of the relay (see :class:`~clorch_repl.session.relay.Relay`)."""

    def light_answers(self) -> dict[int, dict | None]:
        """Every live rank's flight-recorder group status (cheap), None where it did not answer."""

    def diagnose(self, ranks: list[int] | None = None, *, all_threads: bool = False, fallback: bool = True,
                 timeout_s: float = ..., unanswered: set[int] | None = None) -> tuple[Verdict, list[RankEvidence]]:
        """Where every rank is, lined up (see Relay.diagnose)."""

    def stack_of(self, rank: int) -> str:
        """A rank's faulthandler stack."""


class HangWatch:
    """One cell's hang notice (``notice_s`` seconds of quiet; 0 turns it off)."""

    def __init__(self, asker: Asker, run: CellRun, sink: OutputSink, notice_s: float, now: float) -> None:
        self.asker, self.run, self.sink, self.notice_s = asker, run, sink, notice_s
        #: None: the notice is off, or was given
        self.next_check: float | None = now + notice_s if notice_s > 0 else None
        #: where each rank's collectives stood at the last check (analyse.CollectiveProgress), per rank
        self.seen: dict[int, CollectiveProgress] = {}

    def stop(self) -> None:
        """Being interrupted: the report will say why instead."""
        self.next_check = None

    def due(self, now: float) -> bool:
        return self.next_check is not None and now >= self.next_check and not self.run.over

    def check(self) -> None:
        """No output for ``notice_s``: say why, once, if a collective has been pending as long."""
        now = time.monotonic()
        if now - self.run.last_progress < self.notice_s:
            self.next_check = self.run.last_progress + self.notice_s
            self.seen.clear()  # output came: the next check starts a quiet stretch afresh
            return
        may_hang, unanswered = self._may_hang()
        if not may_hang:
            self.next_check = time.monotonic() + max(HANG_RECHECK_S, self.notice_s / 4)
            return
        verdict, states = self.asker.diagnose(fallback=False, unanswered=unanswered)
        if verdict.stuck and (verdict.pending_s or 0.0) >= self.notice_s:
            silent = [s for s in states if not s.answered and s.dead is None]
            if silent:
                # A rank whose native code holds its GIL (NCCL's .item() or synchronize() may) cannot
                # answer; the others' records still show the collective it is not in. Name it from
                # its faulthandler stack, without asking everyone again.
                for state in silent:
                    state.fallback_stack = self.asker.stack_of(state.rank)
                verdict = analyse(states)
            self.next_check = None  # first: an interrupt landing while it prints must not repeat it
            self.run.outcome.noticed = verdict.sentence  # said once: the report does not repeat it
            self.sink.notice(render.notice(verdict))
            return
        self.next_check = time.monotonic() + max(HANG_RECHECK_S, self.notice_s / 4)

    def _may_hang(self) -> tuple[bool, set[int]]:
        """The periodic check's first question, for the flight recorder's group status only
        (light): whether some rank may have had a collective pending since the last check
        (analyse.CollectiveProgress.stood_still; at the first check of a quiet stretch, pending is
        enough). A training loop that is merely quiet keeps moving, so its ranks are not asked
        for their whole flight record every few seconds: that costs each rank 20-30 ms of CPU
        with its GIL held on gloo, 70 ms and more on NCCL, the status well under 1 ms. Also
        returns the ranks that did not answer (native code holding their GIL), so that the
        whole question does not wait for them a second time."""
        answers = self.asker.light_answers()
        still = False
        for rank, answer in answers.items():
            before = self.seen.pop(rank, None)
            now = progress(answer) if answer is not None else None
            if now is not None:
                self.seen[rank] = now
                still = still or now.stood_still(before)
        return still, {rank for rank, answer in answers.items() if answer is None}
