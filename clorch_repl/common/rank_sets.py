"""How every report names a set of ranks, and how it merges the blocks that ranks share.

One spelling everywhere: ``rank 1``, ``ranks 0,2-3``, ``ranks 0-7``: consecutive ranks as ranges,
commas without spaces, as the output labels (``[ranks 0-7]``), the failure headings
(``---- ranks 0,2-3 ----``), the hang verdicts and the error messages all write them. Before this
module the verdicts said ``ranks 0, 2, 3`` beside a heading's ``ranks 0,2-3``, and a reader had to
check that both meant the same ranks. Pure and standard library only: the notebook's, the ranks'
and the supervisor's modules can all import it.
"""

from __future__ import annotations

import itertools
import logging
from typing import Hashable, Iterable, Sequence, TypeVar

logger = logging.getLogger(__name__)

__all__ = ["ranks_text", "rank_words", "ranks_are", "merge_blocks"]

K = TypeVar("K", bound=Hashable)


def ranks_text(ranks: Iterable[int]) -> str:
    """``0-3,6``: consecutive ranks as ranges, so eight ranks read as ``0-7``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(ordered), key=lambda ir: ir[1] - ir[0]):
        seq = [r for _, r in run]
        parts.append(str(seq[0]) if len(seq) == 1 else f"{seq[0]}-{seq[-1]}")
    return ",".join(parts)


def rank_words(ranks: Iterable[int]) -> str:
    """``rank 1``, ``ranks 0,2`` or ``ranks 0-7``: how messages name ranks (never a Python list);
    ``no rank`` for none."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "no rank"
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {ranks_text(ordered)}"


def ranks_are(ranks: Iterable[int]) -> str:
    """``rank 1 is`` or ``ranks 0,2 are``: :func:`rank_words` with its verb."""
    ordered = sorted(set(ranks))
    return f"{rank_words(ordered)} {'is' if len(ordered) == 1 else 'are'}"


def merge_blocks(blocks: Sequence[tuple[int, K]]) -> list[tuple[tuple[int, ...], K]]:
    """Ranks whose block is the same (``key`` equal) together, each group once, in the order of
    its lowest rank: ``[(0, a), (1, b), (2, a)]`` -> ``[((0, 2), a), ((1,), b)]``.

    Why: four ranks stuck in the same all_reduce give four copies of one stack, and the one rank
    that differs is lost between them. The caller decides what "the same" means (its key) and
    renders each group under one heading (:func:`rank_words`)."""
    groups: dict[K, list[int]] = {}
    for rank, key in sorted(blocks, key=lambda rk: rk[0]):
        groups.setdefault(key, []).append(rank)
    return [(tuple(ranks), key) for key, ranks in groups.items()]
