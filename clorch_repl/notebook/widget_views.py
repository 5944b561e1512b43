"""Where a cell's rank widget views are on the page (a ``tqdm.auto`` bar, a slider), and where a
rank's update of one goes. :class:`~clorch_repl.notebook.display.NotebookDisplay` labels them and
decides when they are shown; this module publishes them.

Why: several ranks' views go into slots made in rank order (:class:`.WidgetRows`: bars read 0, 1,
2, 3 whatever order the ranks made them in), and at a cell's end a rank sends an update of each
view whose text changed (:func:`clorch_repl.kernel.display_log.publish_widget_views`): the rank
showed the view without a display id, so the update has to find the view's display here, by the
widget's model id. A front end without a widget manager (nbclient) then shows the finished bar
instead of its first state; the update carries the view too, so JupyterLab keeps the live widget.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from IPython.display import publish_display_data

from ..session.widget_rows import WIDGET_VIEW, WidgetRows

logger = logging.getLogger(__name__)

_ids = itertools.count()


@dataclass
class WidgetViews:
    """One cell's rank widget views on the page (``ranks``: the cell's ranks); a ``clear_output``
    empties the page, and the caller starts a fresh one."""

    ranks: tuple[int, ...]
    _rows: WidgetRows = field(init=False)
    #: (row, rank) -> the display ids of that slot's label and view
    _slots: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    #: (rank, model id) -> the display ids of the views of that rank's widget shown without a
    #: display id of their own (what :meth:`update` finds)
    _views: dict[tuple[int, str], list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rows = WidgetRows(self.ranks)

    def slotted(self, rank: int, content: dict[str, Any]) -> bool:
        """A widget view of one of several ranks, without a display id of its own: it goes into
        its rank's slot. (One rank's views need no order; an updatable one keeps its id.)"""
        return (len(self.ranks) > 1 and rank in self.ranks and WIDGET_VIEW in (content.get("data") or {})
                and not (content.get("transient") or {}).get("display_id"))

    def fill(self, rank: int, content: dict[str, Any], who: str, before_row: Callable[[], None]) -> None:
        """Fill ``rank``'s slot of its next row with its widget view, labelled ``who``, making the
        row first if it is new (``before_row`` first: the lines before it must reach the page
        first): an empty label display and an empty view display per rank, in rank order, each
        updated in place when its rank's view comes."""
        row, new = self._rows.place(rank)
        if new:
            before_row()
            for r in self.ranks:
                n = next(_ids)
                ids = (f"clorch-widget-{n}-label-rank{r}", f"clorch-widget-{n}-view-rank{r}")
                self._slots[(row, r)] = ids
                for display_id in ids:
                    publish_display_data({"text/plain": ""}, {}, transient={"display_id": display_id})
        label_id, view_id = self._slots[(row, rank)]
        publish_display_data({"text/plain": who.rstrip()}, {}, transient={"display_id": label_id}, update=True)
        data = dict(content.get("data", {}))
        data["text/plain"] = who + data.get("text/plain", "")
        self._remember(rank, data, view_id)
        publish_display_data(data, content.get("metadata") or {}, transient={"display_id": view_id}, update=True)

    def shown(self, rank: int, data: dict[str, Any]) -> dict[str, str] | None:
        """The transient for one rank's display shown as it came (not in a slot) when it holds a
        widget view: a display id of its own, so that :meth:`update` can reach it; None otherwise."""
        n = next(_ids)
        return self._remember(rank, data, f"clorch-widget-{n}-view-rank{rank}")

    def update(self, rank: int, content: dict[str, Any], who: str) -> bool:
        """A rank's update of a widget view this cell showed without a display id (its update at
        the cell's end) replaces that view wherever it is, its text labelled ``who``; True when
        it did, False for an update of any other display."""
        view = (content.get("data") or {}).get(WIDGET_VIEW)
        shown = self._views.get((rank, view.get("model_id"))) if isinstance(view, dict) else None
        if not shown:
            return False
        data = dict(content.get("data", {}))
        data["text/plain"] = who + data.get("text/plain", "")
        for view_id in shown:
            publish_display_data(data, content.get("metadata") or {}, transient={"display_id": view_id}, update=True)
        return True

    def _remember(self, rank: int, data: dict[str, Any], display_id: str) -> dict[str, str] | None:
        view = data.get(WIDGET_VIEW)
        if not isinstance(view, dict) or not isinstance(view.get("model_id"), str):
            return None
        self._views.setdefault((rank, view["model_id"]), []).append(display_id)
        return {"display_id": display_id}
