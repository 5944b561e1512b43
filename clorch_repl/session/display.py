"""Notebook display of rank output: labels, live progress lines, rich output and failures.

Output is written to the notebook kernel's own ``sys.stdout``/``sys.stderr`` and display
publisher while the cell runs, so it streams live and lands in the right cell. Every line and
every rich output says which rank it came from. Progress bars (text rewritten with carriage
returns, e.g. tqdm) get one live line per rank, updated in place, instead of interleaving their
``\\r`` with other ranks' text and garbling both.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from IPython.display import DisplayHandle, clear_output, display, publish_display_data

from .protocol import CellOutcome, RankOutput, Status

_ids = itertools.count()
_LINES = re.compile(r"[^\n]*\n|[^\n]+")
_RED, _BOLD, _RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"
#: An unfinished line is held this long for the rest of it, so that ranks writing a line in
#: pieces at the same time do not chop each other's lines; then it is shown as it is.
PARTIAL_LINE_HOLD_S = 0.5


def label(rank: int) -> str:
    return f"[rank {rank}] "


@dataclass
class _Progress:
    """A line one rank keeps rewriting with carriage returns, shown in its own display."""

    handle: DisplayHandle | None = None
    text: str = ""


@dataclass
class _StreamState:
    #: the rank whose unfinished line ends the notebook's stream right now, if any
    open_line: int | None = None


@dataclass
class NotebookDisplay:
    """An :class:`~clorch_repl.session.relay.OutputSink` that renders into the current cell."""

    _streams: dict[str, _StreamState] = field(default_factory=lambda: {"stdout": _StreamState(),
                                                                       "stderr": _StreamState()})
    _progress: dict[tuple[int, str], _Progress] = field(default_factory=dict)
    _display_ids: dict[tuple[int, str], str] = field(default_factory=dict)
    _partial: dict[tuple[int, str], tuple[str, float]] = field(default_factory=dict)
    #: streams written since the last flush; flushing an ipykernel stream costs two thread hops
    _dirty: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------------------ sink API
    def output(self, item: RankOutput) -> None:
        content = item.content
        if item.kind == "stream":
            self._stream(item.rank, content.get("name", "stdout"), content.get("text", ""))
        elif item.kind in ("display_data", "execute_result"):
            self._rich(item.rank, content)
        elif item.kind == "update_display_data":
            self._update(item.rank, content)
        elif item.kind == "clear_output":
            self._end_lines()
            for progress in self._progress.values():
                progress.handle = None  # its display is gone; the next rewrite shows a new one
            clear_output(wait=bool(content.get("wait", False)))

    def flush(self, final: bool = False) -> None:
        """Push output to the notebook; ``final`` (the cell's end) also shows unfinished lines."""
        if self._partial:
            now = time.monotonic()
            for key, (text, since) in list(self._partial.items()):
                if final or now - since >= PARTIAL_LINE_HOLD_S:
                    del self._partial[key]
                    self._write(key[0], key[1], text)
        for name in self._dirty:
            try:
                getattr(sys, name).flush()
            except (AttributeError, ValueError):
                pass
        self._dirty.clear()

    # ------------------------------------------------------------------------------- streams
    def _stream(self, rank: int, name: str, text: str) -> None:
        name = name if name in self._streams else "stdout"
        for piece in _LINES.findall(text):
            key = (rank, name)
            if key in self._partial:
                held, since = self._partial.pop(key)
                piece = held + piece
            else:
                since = time.monotonic()
            if key in self._progress or "\r" in piece:
                self._rewrite(rank, name, piece)
            elif piece.endswith("\n"):
                self._write(rank, name, piece)
            else:
                self._partial[key] = (piece, since)

    def _write(self, rank: int, name: str, piece: str) -> None:
        state = self._streams[name]
        out = getattr(sys, name)
        self._dirty.add(name)
        if state.open_line != rank:
            prefix = "\n" if state.open_line is not None else ""
            out.write(prefix + label(rank))
        out.write(piece)
        state.open_line = None if piece.endswith("\n") else rank

    def _rewrite(self, rank: int, name: str, piece: str) -> None:
        state = self._streams[name]
        if state.open_line == rank:  # the line it had started is being overwritten: close it
            self._dirty.add(name)
            getattr(sys, name).write("\n")
            state.open_line = None
        progress = self._progress.setdefault((rank, name), _Progress())
        done = piece.endswith("\n")
        text = progress.text + piece.rstrip("\n")
        visible = text.rstrip("\r").rsplit("\r", 1)[-1]
        progress.text = visible + ("\r" if text.endswith("\r") else "")
        bundle = {"text/plain": label(rank) + visible}
        if progress.handle is None:
            progress.handle = display(bundle, raw=True, display_id=f"clorch-progress-{next(_ids)}")
        else:
            progress.handle.update(bundle, raw=True)
        if done:
            del self._progress[(rank, name)]

    def _end_lines(self) -> None:
        self.flush(final=True)
        for name, state in self._streams.items():
            if state.open_line is not None:
                self._dirty.add(name)
                getattr(sys, name).write("\n")
                state.open_line = None

    # ---------------------------------------------------------------------------------- rich
    def _rich(self, rank: int, content: dict[str, Any]) -> None:
        self._end_lines()
        data = dict(content.get("data", {}))
        if set(data) - {"text/plain"}:
            sys.stdout.write(label(rank).rstrip() + "\n")  # a label line above plots, tables, HTML
            sys.stdout.flush()
        if "text/plain" in data:
            data["text/plain"] = label(rank) + data["text/plain"]
        transient = self._transient(rank, content)
        publish_display_data(data, content.get("metadata") or {}, transient=transient)

    def _update(self, rank: int, content: dict[str, Any]) -> None:
        transient = self._transient(rank, content)
        if transient is None:
            return
        data = dict(content.get("data", {}))
        if "text/plain" in data:
            data["text/plain"] = label(rank) + data["text/plain"]
        publish_display_data(data, content.get("metadata") or {}, transient=transient, update=True)

    def _transient(self, rank: int, content: dict[str, Any]) -> dict[str, str] | None:
        """Display ids are per kernel; two ranks using the same id must not update each other's."""
        display_id = (content.get("transient") or {}).get("display_id")
        if not display_id:
            return None
        key = (rank, display_id)
        if key not in self._display_ids:
            self._display_ids[key] = f"clorch-{next(_ids)}-rank{rank}-{display_id}"
        return {"display_id": self._display_ids[key]}


class DistributedCellError(Exception):
    """A ``%%distributed`` cell failed on one or more ranks.

    IPython shows ``_render_traceback_`` instead of a Python traceback, so the notebook shows each
    failed rank's own traceback (and nothing from inside clorch_repl), and the cell is marked failed.
    """

    def __init__(self, outcome: CellOutcome, timeout_s: float | None = None) -> None:
        self.outcome = outcome
        self.timeout_s = timeout_s
        super().__init__(self.summary())

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(o.rank for o in self.outcome.failed)

    def summary(self) -> str:
        parts = []
        for result in sorted(self.outcome.failed, key=lambda o: o.rank):
            if result.status is Status.DIED:
                parts.append(f"rank {result.rank} died ({result.exit})")
            elif result.status is Status.STUCK:
                parts.append(f"rank {result.rank} did not return after the interrupt")
            elif result.status is Status.INTERRUPTED:
                parts.append(f"rank {result.rank} interrupted")
            elif result.error is not None:
                parts.append(f"rank {result.rank}: {result.error.ename}: {result.error.evalue}")
        if self.outcome.timed_out:
            parts.insert(0, f"the cell timed out after {self.timeout_s:g} s")
        elif self.outcome.interrupted and not parts:
            parts.append("interrupted")
        return "; ".join(parts) or "the cell failed"

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = []
        if self.outcome.timed_out:
            lines.append(f"{_RED}{_BOLD}Timed out{_RESET} after {self.timeout_s:g} s; the ranks were interrupted.")
        for result in sorted(self.outcome.failed, key=lambda o: o.rank):
            head = f"{_BOLD}---- rank {result.rank} ----{_RESET}"
            lines.append(head)
            if result.status is Status.DIED:
                lines.append(f"{_RED}rank {result.rank} died{_RESET}: {result.exit}.")
                if result.log_tail:
                    lines.append("Last lines of its log:")
                    lines.extend("    " + line for line in result.log_tail.rstrip().splitlines())
            elif result.status is Status.STUCK:
                lines.append(f"{_RED}rank {result.rank} did not return{_RESET} within the grace period "
                             "after being interrupted (blocked in native code, e.g. a collective "
                             "waiting for another rank).")
                if result.stack:
                    lines.append("Where it is now:")
                    lines.extend("    " + line for line in result.stack.rstrip().splitlines())
            elif result.error is not None:
                lines.extend(result.error.traceback or [f"{result.error.ename}: {result.error.evalue}"])
        dead_or_stuck = [o.rank for o in self.outcome.failed if o.status in (Status.DIED, Status.STUCK)]
        if dead_or_stuck:
            lines.append(f"The process group is broken or busy on rank(s) {dead_or_stuck}: "
                         "run %clorch restart for a fresh group (%clorch status shows each rank).")
        return lines
