"""Where the ranks are, asked while they run: the relay's questions to them (``%clorch why``, the
hang notice, the report of a stuck rank).

Why apart from :mod:`.relay`: the relay carries a cell's messages; these questions go over other
channels (each rank's control socket, its faulthandler dump through the launcher) and only read
what the relay holds (the waiting prompts, the ranks the debugger paused, the cells' names).
:class:`AsksRanks` is a part of :class:`~clorch_repl.session.relay.Relay`, on its owner's thread.
"""

from __future__ import annotations

import logging
import time
from functools import cached_property

from ..diagnosis import render
from ..diagnosis.analyse import RankEvidence, Verdict, analyse
from ..diagnosis.deaths import DeathsSeen
from ..diagnosis.entries import progress
from ..diagnosis.moving import SECOND_LOOK_S, moved_on, moving_verdict
from ..diagnosis.probe import PROBE_TIMEOUT_S, Prober
from ..launchers.base import Launcher
from .cell_files import CellNames
from .ledger import Ledger
from .waited import WaitedCell

logger = logging.getLogger(__name__)


class AsksRanks:
    """The relay's questions to its ranks (see the module docstring)."""

    _launcher: Launcher
    _prober: Prober
    _waited: WaitedCell
    ledger: Ledger
    cell_names: CellNames

    def diagnose(self, ranks: list[int] | None = None, *, all_threads: bool = False,
                 fallback: bool = True, timeout_s: float = PROBE_TIMEOUT_S,
                 unanswered: set[int] | None = None) -> tuple[Verdict, list[RankEvidence]]:
        """Ask the ranks where they are (over control, while they run) and line the answers up.

        A rank that does not answer within ``timeout_s`` (native code holding its GIL) is shown
        with its faulthandler stack when ``fallback`` is set. Ranks in ``unanswered`` have just
        failed to answer a question: they are not asked again (each would cost the wait again)."""
        ranks = [p.rank for p in self._launcher.ranks] if ranks is None else ranks
        alive = [r for r in ranks if self._launcher.ranks[r].alive and r not in (unanswered or ())]
        answers = self._prober.ask(alive, all_threads=all_threads, timeout_s=timeout_s)
        states = []
        for rank in ranks:
            proc = self._launcher.ranks[rank]
            if not proc.alive:
                states.append(RankEvidence(rank, dead=proc.exit, host=proc.host))
                continue
            stdin = self._waited.stdin
            state = RankEvidence(rank, answer=answers.get(rank), host=proc.host,
                                 prompt=stdin.prompts.get(rank) if stdin is not None else None,
                                 paused=rank in self.ledger.debug_paused)
            if not state.answered and fallback:
                state.fallback_stack = self.stack_of(rank)
            states.append(state)
        self.deaths_seen.fill(states, lambda rank: self._launcher.ranks[rank].started_at)
        return analyse(states), states

    def why(self, shown: list[int] | None = None, *, all_threads: bool = False) -> str:
        """``%clorch why``: every rank asked (the cause may be any), the verdict, and ``shown``'s
        evidence (None: every rank's), weighed against every rank's (rank 0's alone called
        completed what a dead peer ended). Where the look found collectives pending, a second, light
        look :data:`~.moving.SECOND_LOOK_S` later says whether they moved on: one look at a busy,
        healthy group always finds one pending (:mod:`clorch_repl.diagnosis.moving`)."""
        verdict, states = self.diagnose(all_threads=all_threads)
        first = {s.rank: p for s in states
                 if s.answered and (p := progress(s.answer or {})) is not None and p.pending}
        if verdict.hang and not verdict.mismatch and first:  # (calls that differ may complete, wrongly)
            time.sleep(SECOND_LOOK_S)
            later = self._prober.ask(sorted(first), light=True)
            second = {rank: progress(answer) if answer is not None else None for rank, answer in later.items()}
            if moved_on(first, second):
                verdict = moving_verdict(verdict, sorted(first))
        return render.report(verdict, states, all_threads=all_threads, shown=shown)

    @cached_property
    def deaths_seen(self) -> DeathsSeen:
        """The cells the ranks ran when each death was first seen: a later look (``%clorch why``
        after other cells) judges the collectives a death may have ended as the death report did."""
        return DeathsSeen()

    def light_answers(self) -> dict[int, dict | None]:
        """Every live rank's flight-recorder group status (the hang watch's cheap question)."""
        return self._prober.ask([p.rank for p in self._launcher.ranks if p.alive], light=True)

    def stack_of(self, rank: int) -> str:
        """Where ``rank``'s main thread is now, from its faulthandler (answers while native code
        holds its GIL), its cells named as the notebook shows them (``Cell In[12], line 3``)."""
        return self.cell_names.name(self._launcher.dump_stack(rank), rank)

    def _diagnosis_text(self, timeout_s: float = PROBE_TIMEOUT_S,
                        raised: dict[int, tuple[str, str]] | None = None) -> str:
        """A failed cell's diagnosis; ``raised``: what ranks raised in the cell (rank -> exception
        name and message, :meth:`CellRun.raised`), which the probe cannot know: such a rank is back
        at its prompt when asked."""
        verdict, states = self.diagnose(timeout_s=timeout_s)
        if raised:
            states = render.with_raised(states, raised)
            verdict = analyse(states)
        return render.report(verdict, states)
