"""How much of a cell's output reaches the page: the cell's limits, the budgets that keep them
(pure logic), and the one line that says what was held back.

Why: a runaway ``while True: print(...)`` on every rank used to send hundreds of megabytes to the
notebook kernel and a browser tab that did not survive it; later, with 1 MiB and 10,000 lines
forwarded per rank, JupyterLab still re-rendered a growing 1 MB output several times a second and
its main thread was blocked for up to 4.1 s at a time (a click on Interrupt took 4.5 s). JupyterLab
re-renders a stream output whole each time text is appended to it, so what a flood costs the page
grows with what is already shown. Measured in headless Chromium (tests/browser/test_lab_glance.py,
3 ranks printing 100-character lines on the shared 2-core box): 10,000 lines shown gave tasks of
380-420 ms, 5,000 lines 320 ms, 2,000 lines 100-185 ms, 700 lines none over 50 ms. The limits
below keep the page at the last of those, with room for a slower machine.

The limits (:class:`Limits`) are the cell's, across all its ranks, as the page shows them:

* ``volume``: at most this many characters in all (default 100 KiB);
* ``lines``: at most this many lines in all (default 1,000);
* ``rate``: at most this many characters a second, from a bucket that holds ``2 * rate``
  (default 50 KiB/s: a burst of 100 KiB, then a steady log never waits).

They are kept in three places. The notebook's display keeps them for the cell as shown
(notebook/held_notice.py: merged lines count once), and says at the top of the cell's output what it
held back, while the cell runs. Each rank holds back, at the source, what exceeds
:func:`at_source` (twice the cell's volume and lines, the same rate): that is never serialised and
never crosses ZeroMQ, and as it is larger than the cell's, the page's limit is reached first and
the notebook knows, live, that output is held back. The relay's guard (``backstop``, in
:mod:`clorch_repl.session.flood_guard`, the notebook's side) bounds every rank's messages of all
kinds. What a rank or the guard held back is reported as a structured display (:data:`HELD_MIME`), never as text the notebook would have to read. The rank's log gets
every byte (the rank's stream echoes before it asks the budget).

The notebook's environment sets them (``%env CLORCH_OUTPUT_LIMIT=...``, read at every cell, see
:func:`limits_from_env`), and the relay sends them with each cell (``wire.OUTPUT_LIMITS_KEY``).
Once a write is held back, the rest of its line is held back too, so what is shown never has
lines spliced from pieces; once the volume or the lines ran out, the rest of the cell is held
(the rate only delays: what the bucket refuses is held, and output resumes once it refills).
Nothing here looks at what the text says.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..common import env_vars

logger = logging.getLogger(__name__)

VOLUME_ENV = env_vars.OUTPUT_LIMIT.name
LINES_ENV = env_vars.OUTPUT_LINES.name
RATE_ENV = env_vars.OUTPUT_RATE.name
DEFAULT_VOLUME = int(env_vars.OUTPUT_LIMIT.default or 0)
DEFAULT_LINES = int(env_vars.OUTPUT_LINES.default or 0)
DEFAULT_RATE = int(env_vars.OUTPUT_RATE.default or 0)
#: A rank's own budget is this many times the cell's volume and lines (see :func:`at_source`).
SOURCE_FACTOR = 2
#: The mime type of a report of held-back output (a rank's, the relay's guard's): a display the
#: notebook's display reads and does not show (notebook/held_notice.py); other clients show its
#: text/plain.
HELD_MIME = "application/vnd.clorch.held+json"
#: The bucket holds this many seconds of the rate.
BURST_S = 2.0


@dataclass(frozen=True)
class Limits:
    """A cell's limits, across its ranks; 0 in a field means no limit of that kind."""

    volume: int = DEFAULT_VOLUME
    lines: int = DEFAULT_LINES
    rate: int = DEFAULT_RATE

    def to_wire(self) -> dict[str, int]:
        return {"volume": self.volume, "lines": self.lines, "rate": self.rate}

    @classmethod
    def from_wire(cls, value: Any) -> Limits:
        """The limits a request carried; the defaults for anything missing or malformed (a
        request from a client other than the relay carries none)."""
        if not isinstance(value, Mapping):
            return cls()
        fields = {}
        for name in ("volume", "lines", "rate"):
            v = value.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                fields[name] = v
        return cls(**fields)

    def describe(self) -> str:
        parts = []
        if self.lines:
            parts.append(f"{self.lines:,} lines")
        if self.volume:
            parts.append(_size(self.volume))
        if self.rate:
            parts.append(f"{_size(self.rate)}/s")
        return ", ".join(parts) or "no limits"


def limits_from_env(environ: Mapping[str, str]) -> Limits:
    """The notebook's limits: ``CLORCH_OUTPUT_LIMIT`` (characters per rank per cell, ``k``/``M``
    suffixes allowed), ``CLORCH_OUTPUT_LINES``, ``CLORCH_OUTPUT_RATE`` (characters a second);
    ``0`` turns one off. A value that cannot be read raises ValueError naming the variable."""
    values = {}
    for name, env, default in (("volume", VOLUME_ENV, DEFAULT_VOLUME), ("lines", LINES_ENV, DEFAULT_LINES),
                               ("rate", RATE_ENV, DEFAULT_RATE)):
        raw = environ.get(env, "").strip()
        values[name] = default if not raw else _parse_size(env, raw)
    return Limits(**values)


def _parse_size(env: str, raw: str) -> int:
    scale = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}.get(raw[-1].lower(), 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not a size: give a number of characters, e.g. 1M, 512k "
                         f"or 0 for no limit") from None
    if value < 0:
        raise ValueError(f"{env}={raw!r} is negative: give a number of characters, or 0 for no limit")
    return value


class Budget:
    """One rank's output budget for one cell: :meth:`admit` says whether a write is published.

    Pure: the caller passes the time; no clock, no I/O, no lock (the rank's stream holds one)."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.sent_chars = 0
        self.sent_lines = 0
        self.held_chars = 0
        self.held_lines = 0
        self._tokens = float(limits.rate * BURST_S)
        self._at = now
        self._mid_line_held = False  # the last write was held and did not end its line
        self._spent = False  # the volume or the lines ran out: nothing more of this cell is shown
        #: what was held when the cell's held-back line went out (see :meth:`late_line`)
        self._announced = (0, 0)
        #: what earlier budgets held unannounced, to be said with this one's (see :meth:`carry_late`)
        self._carried = (0, 0)

    def admit(self, text: str, now: float) -> bool:
        """Whether ``text`` (one write) is published; either way it is counted."""
        return self.admit_size(len(text), text.count("\n"), text.endswith("\n"), now)

    def admit_size(self, chars: int, lines: int, ends_line: bool, now: float) -> bool:
        """:meth:`admit` for a piece known by its size (the relay's messages, see ``flood_guard.message_size``)."""
        ok = not self._spent and not self._mid_line_held and self._fits(chars, lines, now)
        if ok:
            self.sent_chars += chars
            self.sent_lines += lines
            if self.limits.rate:
                self._tokens -= chars
        else:
            self.held_chars += chars
            self.held_lines += lines
            self._mid_line_held = not ends_line
        return ok

    def _fits(self, chars: int, lines: int, now: float) -> bool:
        limits = self.limits
        if ((limits.volume and self.sent_chars + chars > limits.volume)
                or (limits.lines and self.sent_lines + max(lines, 1) > limits.lines)):
            self._spent = True  # later, smaller writes would show lines out of their context
            return False
        if limits.rate:
            self._tokens = min(limits.rate * BURST_S, self._tokens + (now - self._at) * limits.rate)
            self._at = now
            if chars > self._tokens:
                return False
        return True

    @property
    def held(self) -> bool:
        return self.held_chars > 0

    def held_report(self, rank: int | str) -> dict[str, Any] | None:
        """What the rank held back of the cell, published at the cell's end (:data:`HELD_MIME`),
        or None when nothing was."""
        if not self.held:
            return None
        return {"rank": rank, "lines": self.held_lines, "chars": self.held_chars, "late": False}

    def mark_announced(self) -> None:
        """The cell's held-back line went out: what is held from now on is a thread's, after it."""
        self._announced = (self.held_chars, self.held_lines)

    def carry_late(self, previous: Budget) -> None:
        """This cell is clorch_repl's own (silent: not the place for a user's notice): what
        ``previous`` held unannounced stays to be said at the next cell of the user's, with
        whatever this one holds after its own line."""
        chars, lines = previous._unannounced()
        self._carried = (self._carried[0] + chars, self._carried[1] + lines)

    def _unannounced(self) -> tuple[int, int]:
        return (self.held_chars - self._announced[0] + self._carried[0],
                self.held_lines - self._announced[1] + self._carried[1])

    def late_report(self, rank: int | str) -> dict[str, Any] | None:
        """What was held back after the cell's own report (a thread the cell left printing into
        a spent budget), published when the next cell starts; None when nothing was. Without it
        such output would go to the log with nothing in the notebook saying so."""
        chars, lines = self._unannounced()
        if chars <= 0:
            return None
        return {"rank": rank, "lines": lines, "chars": chars, "late": True}


def held_display(report: dict[str, Any]) -> dict[str, Any]:
    """A held-back report as a display's data: the structured report, and a line for a client
    other than clorch's notebook (which reads the report and shows one line at the cell's top)."""
    rank = report["rank"]
    when = " after the cell ended" if report.get("late") else ""
    text = (f"clorch: rank {rank} held back {report['lines']:,} line(s), {_size(report['chars'])}, of a cell's "
            f"output{when}; the rank's log has all of it: %clorch logs {rank}")
    return {HELD_MIME: dict(report), "text/plain": text}


def at_source(limits: Limits) -> Limits:
    """A rank's own budget for a cell of ``limits``: larger than the cell's, so that the notebook,
    which keeps the cell's, is the first to hold output back and can say so while the cell runs."""
    return Limits(volume=limits.volume * SOURCE_FACTOR, lines=limits.lines * SOURCE_FACTOR, rate=limits.rate)


def _size(chars: int) -> str:
    if chars >= 1024 ** 2:
        return f"{chars / 1024 ** 2:.1f} MiB"
    if chars >= 1024:
        return f"{chars / 1024:.0f} KiB"
    return f"{chars} B"
