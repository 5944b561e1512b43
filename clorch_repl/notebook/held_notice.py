"""The cell's output limits as the page sees them, and the one line at the top of the cell's output
that says what was held back (see :mod:`clorch_repl.wire.limits` for the limits and why they are what they are).

Why at the top: the line used to come at the cell's end, under the thousands of lines a flood had
shown, one 330-character line per rank, wrapped by the browser in the middle of a word. Here the
display keeps the cell's limits across all its ranks (a line merged from three ranks is shown, and
counted, once) and reserves a display at the top of the cell's output before its first line; that
display is updated in place (its display_id), at most every :data:`REFRESH_S` while the cell runs,
and once more at its end, when the ranks' own reports (flood.HELD_MIME) have come.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any, Iterable

from IPython.display import publish_display_data

from ..common.human import wrap
from ..common.rank_sets import ranks_text
from ..wire.limits import HELD_MIME, Budget, Limits, limits_from_env

logger = logging.getLogger(__name__)

_ids = itertools.count()
#: How often, at most, the line is rewritten while the cell runs: each rewrite is a message the
#: page renders, and a flood is when it must not get many.
REFRESH_S = 0.5


def page_limits() -> Limits:
    """The cell's limits from the notebook's environment; the defaults where it cannot be read
    (the cell's request raised that error already, see Session.request)."""
    try:
        return limits_from_env(os.environ)
    except ValueError as exc:
        logger.debug("output limits: %s", exc)
        return Limits()


class HeldNotice:
    """The page's budget for one cell's stream output, and the line saying what was held back."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or page_limits()
        self.budget = Budget(self.limits, time.monotonic())
        self._display_id: str | None = None
        #: per rank: [lines, characters] the page held back (a merged line counts for each rank)
        self._page: dict[int, list[int]] = {}
        #: per rank: what it (or the relay's guard) reported holding back, this cell and late
        self._reported: dict[tuple[int, bool], list[int]] = {}
        self._shown = ""
        self._shown_at = 0.0

    def reserve(self) -> None:
        """Before the cell's first line: an empty display at the top of its output, to be
        filled in place if anything is held back (nothing shows while it is empty)."""
        if self._display_id is None:
            self._display_id = f"clorch-held-{next(_ids)}"
            publish_display_data({"text/plain": ""}, {}, transient={"display_id": self._display_id})

    def cleared(self) -> None:
        """The cell's output was cleared (clear_output): the next line reserves a new display."""
        self._display_id, self._shown = None, ""

    def admit(self, ranks: Iterable[int], text: str) -> bool:
        """Whether ``text`` (a piece of a line, shown once for ``ranks``) goes to the page."""
        if self.budget.admit(text, time.monotonic()):
            return True
        for rank in ranks:
            held = self._page.setdefault(rank, [0, 0])
            held[0] += text.count("\n")
            held[1] += len(text)
        return False

    def report(self, rank: int, data: dict[str, Any]) -> bool:
        """A held-back report (``data`` of a display); False when ``data`` is not one."""
        report = data.get(HELD_MIME)
        if not isinstance(report, dict):
            return False
        key = (rank, bool(report.get("late")))
        held = self._reported.setdefault(key, [0, 0])
        held[0] += int(report.get("lines") or 0)
        held[1] += int(report.get("chars") or 0)
        return True

    def text(self) -> str:
        """The line (wrapped at the cell's width), or "" when nothing was held back. Lines are the
        ranks' lines: one merged from three ranks counts three."""
        counts: dict[int, list[int]] = {}
        for source in (self._page.items(), ((r, v) for (r, late), v in self._reported.items() if not late)):
            for rank, (lines, chars) in source:
                total = counts.setdefault(rank, [0, 0])
                total[0] += lines
                total[1] += chars
        late = {r: v for (r, is_late), v in self._reported.items() if is_late}
        parts = []
        if counts:
            lines, chars = (sum(v[i] for v in counts.values()) for i in (0, 1))
            parts.append(f"clorch held back {_lines(lines)} ({_size(chars)}) of this cell's output; {_logs(counts)}")
        if late:
            lines, chars = (sum(v[i] for v in late.values()) for i in (0, 1))
            parts.append(f"clorch held back {_lines(lines)} ({_size(chars)}) printed after their cell ended; "
                         f"{_logs(late)}")
        return wrap("\n".join(parts), indent="  ")

    def refresh(self, final: bool = False) -> None:
        """Rewrite the line if it changed (at most every REFRESH_S while the cell runs)."""
        now = time.monotonic()
        if not final and now - self._shown_at < REFRESH_S:
            return
        text = self.text()
        if text == self._shown:
            return
        if self._display_id is None:
            self.reserve()  # nothing was shown before: the report is the cell's first output
        self._shown, self._shown_at = text, now
        publish_display_data({"text/plain": text}, {}, transient={"display_id": self._display_id}, update=True)


def _logs(counts: dict[int, Any]) -> str:
    """Where it all is, short enough for the line to fit the cell's width (the limits are in the
    README and flood's docstring: the line says what happened and where to look)."""
    ranks = sorted(counts)
    if len(ranks) == 1:
        return f"all in %clorch logs {ranks[0]}"
    return f"all in %clorch logs RANK ({ranks_text(ranks)})"


def _lines(n: int) -> str:
    return f"{n:,} line" if n == 1 else f"{n:,} lines"


def _size(chars: int) -> str:
    if chars >= 1024 ** 2:
        return f"{chars / 1024 ** 2:.1f} MiB"
    return f"{chars / 1024:.0f} KiB" if chars >= 1024 else f"{chars} B"
