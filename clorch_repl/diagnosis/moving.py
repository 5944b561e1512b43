"""Whether the collectives one look found pending are moving on: ``%clorch why`` between cells.

Why: ``%clorch why`` looks at the ranks once. A healthy session whose thread runs collectives all
the time (a try-out's: about 900 all_reduces a second from a background thread) always has one
pending at the moment of a look, so the look alone said "ranks 0-1 wait in it", and when it caught
one rank between two calls, "rank 1 waits in it; rank 0 never called it": a hang that was not
there. A second, light look a moment later (each rank's flight-recorder group status, no entries)
says whether those collectives moved on; the hang check during a cell compares two looks the same
way (:meth:`~.entries.CollectiveProgress.stood_still`). Pure: the caller looks.
"""

from __future__ import annotations

from dataclasses import replace

from ..common.rank_sets import rank_words
from .entries import CollectiveProgress, Verdict

#: How long after the first look the second one is made: collectives that move on at all move on
#: within it (a gloo all_reduce of a few floats takes about a millisecond), and ``%clorch why``
#: waits for it only when the first look found one pending
SECOND_LOOK_S = 0.3


def moved_on(first: dict[int, CollectiveProgress], second: dict[int, CollectiveProgress | None]) -> bool:
    """Whether every rank of ``first`` (those whose first look found a collective pending) has
    completed more since, by ``second`` (the light look; None: no answer); False as soon as one
    stood still or did not answer: a hang there stays the verdict."""
    for rank, before in first.items():
        after = second.get(rank)
        if after is None or after.stood_still(before):
            return False
    return bool(first)


def moving_verdict(verdict: Verdict, ranks: list[int]) -> Verdict:
    """``verdict`` (the first look's) said again for collectives that moved on (:func:`moved_on`):
    no hang, and the first look's sentence kept as what the evidence below shows."""
    sentence = (f"no collective is stuck: {rank_words(ranks)} completed more collectives in the "
                f"{SECOND_LOOK_S:.1f} s after the look below, which caught {'it' if len(ranks) == 1 else 'them'} "
                f"in one ({verdict.sentence})")
    return replace(verdict, sentence=sentence, hang=False, waiting=[], missing=[], mismatch=False)
