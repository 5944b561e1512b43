"""Which of a survivor's collectives a rank's death may have ended: the one rule behind "ended,
perhaps failed (rank 1 of its group died)" in the evidence and "the last collective of ranks 0,2
was ..." in the verdict, for the cell's death report and ``%clorch why`` alike.

Why a rule of its own: torch's flight recorder retires a collective that failed because a peer
died (gloo fails it once the peer's sockets close) exactly as it retires one that worked, so the
records cannot tell the two apart; only when the collective was called, against when the rank
died, can. The notebook does not know when a rank died, but it knows the cell each survivor was
running when the death was first seen (:class:`DeathsSeen`): a collective called in that cell or
later may have failed of it, one called before it had ended before that cell began.

Pure but for :class:`DeathsSeen`, which the notebook keeps for as long as its ranks.
"""

from __future__ import annotations

from typing import Callable

from .entries import Entry, RankEvidence, members_of


def ended_by(state: RankEvidence, entry: Entry, dead: list[RankEvidence]) -> list[int]:
    """The ranks of ``dead`` whose death may have ended ``entry`` on ``state``'s rank: those for
    which it was called in the cell ``state``'s rank was running when the death was first seen
    (:attr:`RankEvidence.died_in`), or later; where that was not seen, in the rank's latest cell
    (its answer's ``cell_began_ns``). Every time is the rank's own (the flight recorder's clock),
    and a time not known counts the entry in.

    The cell, not "the last collective whenever it was": a death report once blamed the session's
    start-up barrier, completed long before, for a rank that had run no collective in the cell (a
    try-out). The cell of the death, not the latest one: ``%clorch why`` after a cell the
    survivors ran called "completed" the all_reduce the death report had doubted (a try-out)."""
    created = entry.raw.get("time_created_ns")
    latest = (state.answer or {}).get("cell_began_ns")
    out = []
    for gone in dead:
        began = gone.died_in.get(state.rank, latest)
        if not began or not created or int(created) >= int(began):
            out.append(gone.rank)
    return out


def lost_members(state: RankEvidence, entry: Entry, states: list[RankEvidence]) -> list[int]:
    """The dead members of ``entry``'s group whose death may have ended it (:func:`ended_by`);
    ``states``: every rank's evidence, not only the ranks a report shows (``%clorch why --rank
    0`` weighed rank 0 alone, found no dead member beside it, and said "completed")."""
    members = members_of(entry.pg, states)
    return ended_by(state, entry, [s for s in states if s.dead is not None and s.rank in members])


class DeathsSeen:
    """The cells the ranks were running when each death was first seen, so that every later look
    (``%clorch why`` after other cells) judges the collectives by the same cell as the death
    report did. One per session's ranks; a rank replaced and dead again is a new death (its
    process's start time tells them apart)."""

    def __init__(self) -> None:
        #: (rank, its process's start time) -> the other ranks' ``cell_began_ns`` then
        self._cells: dict[tuple[int, float], dict[int, int]] = {}

    def fill(self, states: list[RankEvidence], started: Callable[[int], float]) -> None:
        """Give each dead rank of ``states`` its :attr:`~RankEvidence.died_in`: the cells of the
        first look that found it dead, this one if none did before. ``started(rank)``: when the
        rank's process started (the launcher's ``started_at``)."""
        running = {s.rank: int(began) for s in states
                   if s.answered and (began := (s.answer or {}).get("cell_began_ns"))}
        for state in states:
            if state.dead is None:
                continue
            key = (state.rank, started(state.rank))
            self._cells = {k: v for k, v in self._cells.items() if k[0] != state.rank or k == key}
            state.died_in = dict(self._cells.setdefault(key, running))
