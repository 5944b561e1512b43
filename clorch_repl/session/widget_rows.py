"""Where each rank's widget views go in a cell's output: rows of one slot per rank, in rank order
(pure: no display; :class:`~clorch_repl.notebook.display.NotebookDisplay` fills the slots).

Why: ranks make their tqdm.auto bars in whatever order they reach them, and shown as they came
four bars read 2, 0, 3, 1; in slots made in rank order they read 0, 1, 2, 3.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: The MIME type of an ipywidgets view in a display_data.
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@dataclass
class WidgetRows:
    """Which row of slots each rank's next widget view goes into (pure: no display).

    Each rank's first widget view of the cell goes into row 0, its second into row 1, and so on;
    a row is made, one slot per rank of the cell in rank order, when the first rank's view for it
    comes. So rank 2's bar, made before rank 0's, still lands below it. A slot shows nothing until
    its rank's view fills it (``if rank == 0: display(slider)`` leaves no stray labels)."""

    ranks: tuple[int, ...]
    rows: int = 0
    _shown: dict[int, int] = field(default_factory=dict)

    def place(self, rank: int) -> tuple[int, bool]:
        """(the row for ``rank``'s next view, whether that row's slots must be made first)."""
        row = self._shown.get(rank, 0)
        self._shown[rank] = row + 1
        new = row >= self.rows
        self.rows = max(self.rows, row + 1)
        return row, new
