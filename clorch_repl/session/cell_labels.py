"""Which cell each rank was last sent, and when: what ``%clorch top`` shows in its cell column.

Why: the panel read the session's current cell, which is cleared when the cell's wait ends, so a
rank left stuck in a cell (an interrupt it did not survive) read "busy" with "-" for its cell and
time. The session records every cell it sends here (:meth:`RankCells.sent`), and the panel asks
about a rank while the relay says it is busy (:meth:`RankCells.of`).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

logger = logging.getLogger(__name__)


class RankCells:
    """Per rank: the label of the last cell sent to it (``[5] first line``) and when."""

    def __init__(self) -> None:
        self._cells: dict[int, tuple[str, float]] = {}

    def sent(self, label: str, ranks: tuple[int, ...]) -> tuple[str, tuple[int, ...], float]:
        """A cell was sent to ``ranks``; returns the session's ``current_cell`` for it."""
        now = time.monotonic()
        self._cells.update(dict.fromkeys(ranks, (label, now)))
        return label, ranks, now

    def of(self, rank: int, busy: Iterable[int]) -> tuple[str, float] | None:
        """The cell ``rank`` runs and since when, if it is ``busy`` (also after the cell's wait
        ended with the rank stuck in it); None when it is not."""
        return self._cells.get(rank) if rank in set(busy) else None
