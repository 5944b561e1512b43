"""The notebook's side of a cell's output limits (:mod:`clorch_repl.wire.limits`, which both sides
read): the relay's guard over every rank's messages of a cell, and the bound on what IPython's
history keeps of the text the ranks sent.

Why here and not beside :class:`~clorch_repl.wire.limits.Limits`: a rank never guards the relay
nor touches the notebook's IPython history, and the rank's side imports nothing of the notebook's
(tests/unit/test_layout.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

from ..wire.limits import Budget, Limits, at_source, held_display

logger = logging.getLogger(__name__)

#: The notebook keeps at most this many characters of one cell's relayed text in IPython's
#: ``history_manager.outputs`` (which only ``%notebook``-style exports read), and the records
#: of at most this many cells: it kept every byte of every cell (312 -> 870 MiB over 6,000 cells).
HISTORY_CHARS_PER_CELL = 64 * 1024
HISTORY_CELLS_KEPT = 200


def bound_history(outputs: MutableMapping[int, list[Any]], cell: int,
                  chars_per_cell: int = HISTORY_CHARS_PER_CELL, cells_kept: int = HISTORY_CELLS_KEPT,
                  relayed: list[int] | None = None,
                  exceptions: MutableMapping[int, Any] | None = None) -> None:
    """Bound what IPython's ``history_manager.outputs`` keeps of the relayed text of cell ``cell``.

    IPython records every stream write of a cell (``out_stream``/``err_stream`` records whose
    ``bundle["stream"]`` is a list of pieces) for exports; a ``%%distributed`` cell's writes are
    the ranks' output, so a flood or thousands of cells made the notebook kernel grow without end.
    The cell keeps its first ``chars_per_cell`` characters of stream text (rich records are kept:
    they are one per display), and of the cells listed in ``relayed`` (the caller's list, oldest
    first, appended to here) only the last ``cells_kept`` keep any record, in ``outputs`` and in
    IPython's formatted tracebacks (``exceptions``) alike.

    What is kept is joined into one string per record: the display writes a line's rank label and
    its text separately, so a record held tens of thousands of strings of a few dozen characters,
    each costing about 50 bytes more than its text (measured with tracemalloc in the notebook
    kernel over 300 cells: 28 MB for the 12.8 MB of text the bound allows). Exports join the
    pieces anyway."""
    records = outputs.get(cell)
    if records:
        left = chars_per_cell
        for record in records:
            bundle = getattr(record, "bundle", None)
            pieces = bundle.get("stream") if isinstance(bundle, dict) else None
            if not isinstance(pieces, list):
                continue
            kept = []
            for piece in pieces:
                if left <= 0:
                    break
                text = str(piece)
                kept.append(text[:left])
                left -= len(text)
            pieces[:] = ["".join(kept)] if kept else []
    if relayed is not None:
        if not relayed or relayed[-1] != cell:
            relayed.append(cell)
        while len(relayed) > cells_kept:
            gone = relayed.pop(0)
            outputs.pop(gone, None)
            if exceptions is not None:
                exceptions.pop(gone, None)


#: The notebook's own guard (the relay's): each rank's messages of a cell, all kinds (rich output
#: too, which the rank's stream budget does not see, and ranks reached through ipykernel's own
#: path), are forwarded up to this many times the rank's budget (:func:`at_source`); then held
#: back and counted.
BACKSTOP_FACTOR = 2


def backstop(limits: Limits | None) -> Limits:
    """The relay's guard for a cell whose ranks were given ``limits`` (no rate: the ranks meter)."""
    limits = at_source(limits or Limits())
    return Limits(volume=limits.volume * BACKSTOP_FACTOR, lines=limits.lines * BACKSTOP_FACTOR, rate=0)


def message_size(kind: str, content: Mapping[str, Any]) -> tuple[int, int, bool]:
    """(characters, lines, ends its line) of one output message, as the guard counts it."""
    if kind == "stream":
        text = str(content.get("text", ""))
        return len(text), text.count("\n"), text.endswith("\n")
    data = content.get("data")
    chars = sum(len(v) if isinstance(v, str) else len(repr(v)) for v in data.values()) if isinstance(data, Mapping) else 0
    return chars + 64, 1, True  # a display is a line of the page at least


def withheld_report(rank: int, guard: Budget) -> dict[str, Any] | None:
    """The relay's report (a display's data, see :func:`held_display`) of what its guard held back
    of a rank's cell, or None."""
    if not guard.held:
        return None
    return held_display({"rank": rank, "lines": guard.held_lines, "chars": guard.held_chars, "late": False})
