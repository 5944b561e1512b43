"""Notebook display of rank output: labels, merged identical output, live progress lines, rich
output and failures.

Output is written to the notebook kernel's own ``sys.stdout``/``sys.stderr`` and display
publisher while the cell runs, so it streams live and lands in the right cell. Every line and
every rich output says which rank it came from. Progress bars (text rewritten with carriage
returns, e.g. tqdm) get one live line per rank, updated in place, instead of interleaving their
``\\r`` with other ranks' text and garbling both.

Merging: SPMD code prints the same line on every rank, and eight copies of it drown the cell. A
line (or a rich output, or the cell's value) that every rank of the cell produced identically, at
the same place in each rank's own output, is shown once, labelled with the ranks: ``[ranks 0-7]``
(always the explicit list, never "all ranks": the label is the same whether the cell ran on every
rank or on ``--ranks``, and says how many ranks agreed). Each rank's output is a queue of units
(complete lines, rich outputs); a unit waits at most :data:`MERGE_HOLD_S` for the other ranks to
produce theirs. Units that differ are shown per rank, as ``[rank 3]``, in each rank's own order,
so partly identical output stays correct: the shared lines are merged, the rest is per rank.
A rank's line that the other ranks do not have (``if rank == 0: print(...)``) is shown on its own
while the others' next line waits for it to catch up, so one extra line does not end merging for
the rest of the cell. Progress lines, display updates and ``clear_output`` are never merged.

Widget views (a ``tqdm.auto`` bar, a slider) are never merged and never held: they go into slots
in rank order (:class:`.widget_rows.WidgetRows`), so that four ranks' bars read 0, 1, 2, 3 whatever order the
ranks made them in (they arrived 2, 0, 3, 1 when each view was shown as it came). A rank's update of
a view at its cell's end (a finished bar) goes where that view is (:mod:`.widget_views`).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping

from IPython.display import DisplayHandle, clear_output, display, publish_display_data

from ..common.human import wrap
from ..common.rank_sets import ranks_text
from .held_notice import HeldNotice
from ..session.protocol import RankOutput
from .widget_views import WidgetViews

logger = logging.getLogger(__name__)

_ids = itertools.count()
_NONE: collections.Counter[Hashable] = collections.Counter()
_LINES = re.compile(r"[^\n]*\n|[^\n]+")
#: An unfinished line is held this long for the rest of it, so that ranks writing a line in
#: pieces at the same time do not chop each other's lines; then it is shown as it is.
PARTIAL_LINE_HOLD_S = 0.5
#: How long a rank's line waits for the other ranks' copy of it before it is shown on its own.
#: Ranks of one SPMD program print the same line within milliseconds of each other
#: (``python benchmarks/transfer.py`` on the 2-core CPU box: the last copy arrived 2.6-15 ms after
#: the first at the median, 12-60 ms at worst, depending on the load; on two H200s 13 ms at the
#: 99th percentile, one outlier of 0.75 s); a person notices live output lagging at about half a
#: second. A copy later than the hold is shown with its own rank's label: unmerged, never wrong. The relay flushes the display at least every 0.2 s, so
#: the longest a line is held is 0.25 + 0.2 s, still under that.
MERGE_HOLD_S = 0.25


def label(rank: int, hosts: Mapping[int, str] | None = None) -> str:
    """``[rank 3] ``; ``[rank 3 hostB] `` when the session spans hosts (``hosts``: rank -> host)."""
    host = hosts.get(rank) if hosts else None
    return f"[rank {rank} {host}] " if host else f"[rank {rank}] "


def group_label(ranks: Iterable[int], hosts: Mapping[int, str] | None = None) -> str:
    """``[rank 3] `` for one rank, ``[ranks 0-7] `` for several; with ``hosts``, the host too
    where the ranks share one (``[ranks 0-7 hostA] ``)."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return label(ordered[0], hosts)
    shared = {hosts.get(r) for r in ordered} if hosts else set()
    host = next(iter(shared)) if len(shared) == 1 else None
    return f"[ranks {ranks_text(ordered)} {host}] " if host else f"[ranks {ranks_text(ordered)}] "


@dataclass
class _Progress:
    """A line one rank keeps rewriting with carriage returns, shown in its own display."""

    handle: DisplayHandle | None = None
    text: str = ""


@dataclass
class _StreamState:
    #: the label whose unfinished line ends the notebook's stream right now, if any
    open_line: str | None = None


@dataclass
class _Unit:
    """One piece of one rank's output, waiting for its turn (and for the other ranks' copies).

    ``key`` is what must be equal for units of several ranks to be shown as one; ``None`` for
    units that are never merged (progress rewrites, display updates, a line's continuation).
    """

    kind: str            # "line" | "progress" | "rich" | "update" | "clear" | "comm" | "widget"
    payload: Any
    key: Hashable | None
    since: float


@dataclass
class NotebookDisplay:
    """An :class:`~clorch_repl.session.sink.OutputSink` that renders into the current cell.

    ``ranks`` are the ranks the cell runs on; identical output of all of them is merged unless
    ``merge`` is false (``%%distributed --no-merge``) or there is only one rank.
    """

    ranks: tuple[int, ...] = ()
    merge: bool = True
    #: rank -> host for ranks on other hosts (labels then name the host); empty on one host
    hosts: Mapping[int, str] = field(default_factory=dict)
    _streams: dict[str, _StreamState] = field(default_factory=lambda: {"stdout": _StreamState(),
                                                                       "stderr": _StreamState()})
    _progress: dict[tuple[int, str], _Progress] = field(default_factory=dict)
    _display_ids: dict[tuple[int, str], str] = field(default_factory=dict)
    _partial: dict[tuple[int, str], tuple[str, float]] = field(default_factory=dict)
    #: (rank, stream) whose unfinished line has been shown; its rest is never merged
    _continuing: set[tuple[int, str]] = field(default_factory=set)
    #: (rank, stream) in the middle of a carriage-return progress line, as queued
    _rewriting: set[tuple[int, str]] = field(default_factory=set)
    _queues: dict[int, collections.deque[_Unit]] = field(default_factory=dict)
    #: per rank, how many of its queued units have each key (to find a line further down a queue)
    _keys: dict[int, collections.Counter[Hashable]] = field(default_factory=dict)
    #: streams written since the last flush, in the order written; flushing an ipykernel stream
    #: costs two thread hops. At most one at a time: see :meth:`_out`.
    _dirty: dict[str, None] = field(default_factory=dict)
    #: where widget views go (slots in rank order) and their updates at a cell's end
    _widgets: WidgetViews = field(default_factory=lambda: WidgetViews(()))
    #: the cell's output limits on the page, and the line at the top saying what they held back
    held: HeldNotice = field(default_factory=HeldNotice)

    def __post_init__(self) -> None:
        self.ranks = tuple(sorted(set(self.ranks)))
        self.merge = self.merge and len(self.ranks) > 1
        self._widgets = WidgetViews(self.ranks)

    # ------------------------------------------------------------------------------ sink API
    def output(self, item: RankOutput) -> None:
        content = item.content
        rank = item.rank
        if item.kind == "stream":
            self._stream(rank, content.get("name", "stdout"), content.get("text", ""))
        elif item.kind == "display_data" and self.held.report(rank, content.get("data") or {}):
            pass  # a rank's report of what it held back: said in the line at the top
        elif item.kind == "display_data" and self._widgets.slotted(rank, content):
            self._enqueue(rank, "widget", content, None)  # never merged, never held (see WidgetRows)
        elif item.kind in ("display_data", "execute_result"):
            self._enqueue(rank, "rich", content, self._rich_key(rank, item.kind, content))
        elif item.kind == "update_display_data":
            self._enqueue(rank, "update", content, None)
        elif item.kind == "clear_output":
            self._enqueue(rank, "clear", content, None)
        self._drain(time.monotonic(), final=False)

    def flush(self, final: bool = False) -> None:
        """Push output to the notebook; ``final`` (the cell's end) also shows what is held."""
        now = time.monotonic()
        if final:
            self._merge_last_partials()
        for key, (text, since) in list(self._partial.items()):
            if final or now - since >= PARTIAL_LINE_HOLD_S:
                self._release_partial(key, expired=not final)
        self._drain(now, final)
        self._flush_streams()
        self.held.refresh(final)

    def comm(self, rank: int, deliver: Callable[[], None]) -> None:
        """A rank's comm message (a widget's), ``deliver`` publishing it: queued in the rank's
        order with its output, so that a widget's comm_open precedes its view and its comm_close
        follows it, never merged, and never holding a partial line back (see clorch_repl.notebook.comms)."""
        self._queues.setdefault(rank, collections.deque()).append(_Unit("comm", deliver, None, time.monotonic()))
        self._drain(time.monotonic(), final=False)

    def notice(self, text: str) -> None:
        """A message from clorch itself into the running cell (the hang notice), on its own line."""
        self._drain(time.monotonic(), final=False)
        self._end_lines()
        self._out("stdout").write(wrap(text.rstrip("\n"), indent="  ") + "\n")  # a notice, not an error: not on red
        self._flush_streams()

    def _out(self, name: str) -> Any:
        """The notebook's ``sys.stdout`` or ``sys.stderr``, to be written now. Each buffers on its
        own and ipykernel publishes each when it is flushed, so a line written to one after a
        line written to the other could reach the page first (a rank's ``sys.exit`` message above
        the lines it printed before it). The other stream's text is flushed first, so the page
        shows the two in the order they were written."""
        if name not in self._dirty:
            self._flush_streams()
            self._dirty[name] = None
        return getattr(sys, name)

    def _flush_streams(self) -> None:
        for name in self._dirty:
            try:
                getattr(sys, name).flush()
            except (AttributeError, ValueError) as exc:  # a closed or replaced stream
                logger.debug("could not flush sys.%s: %s", name, exc)
        self._dirty.clear()

    # ------------------------------------------------------------------------------- queueing
    def _mergeable(self, rank: int) -> bool:
        return self.merge and rank in self.ranks

    def _rich_key(self, rank: int, kind: str, content: dict[str, Any]) -> Hashable | None:
        if not self._mergeable(rank) or (content.get("transient") or {}).get("display_id"):
            return None  # a display that will be updated belongs to its rank
        try:
            return ("rich", kind, json.dumps(content.get("data", {}), sort_keys=True),
                    json.dumps(content.get("metadata") or {}, sort_keys=True))
        except (TypeError, ValueError):
            return None

    def _enqueue(self, rank: int, kind: str, payload: Any, key: Hashable | None) -> None:
        if kind != "line":
            # the rank's unfinished line came before this output: keep it there
            for name in ("stdout", "stderr"):
                if (rank, name) in self._partial:
                    self._release_partial((rank, name))
        self._queues.setdefault(rank, collections.deque()).append(_Unit(kind, payload, key, time.monotonic()))
        if key is not None:
            self._keys.setdefault(rank, collections.Counter())[key] += 1

    def _pop(self, rank: int) -> _Unit:
        unit = self._queues[rank].popleft()
        if unit.key is not None:
            self._keys[rank][unit.key] -= 1
        return unit

    def _merge_last_partials(self) -> None:
        """At the cell's end, the same unfinished last line on every rank (``print(x, end='')``)
        is one line like any other, labelled once."""
        if not self.merge:
            return
        for name in self._streams:
            keys = [(r, name) for r in self.ranks]
            if not all(k in self._partial for k in keys) or any(k in self._continuing for k in keys):
                continue  # one rank's text is the rest of a line already shown in part: its own
            texts = {self._partial[k][0] for k in keys}
            if len(texts) != 1:
                continue
            text = texts.pop()
            for key in keys:
                del self._partial[key]
                self._enqueue(key[0], "line", (name, text, False), ("line", name, text))

    def _release_partial(self, key: tuple[int, str], expired: bool = False) -> None:
        """An unfinished line waited long enough (``expired``), or other output of its rank comes
        after it, or the cell ends: show it as it is, never merged. Where its hold expired while
        other ranks also write lines in pieces, it becomes the rank's live line, a display of its
        own updated as the rest comes, as a progress line is (``print('.', end='')`` in a loop on
        every rank): written into the stream, each rank's next piece ended another rank's piece on
        screen and began a new labelled line, so every rank's line came out chopped into pieces.
        Otherwise (one rank's slow line, a line its own display follows) the stream, as before."""
        text, _ = self._partial.pop(key)
        if expired and any(k[0] != key[0] for k in (*self._partial, *self._rewriting)):
            self._rewriting.add(key)  # its rest takes the same way, until its newline (see _stream)
            self._enqueue(key[0], "progress", (key[1], text), None)
            return
        self._continuing.add(key)
        self._enqueue(key[0], "line", (key[1], text, False), None)

    def _drain(self, now: float, final: bool) -> None:
        """Show every unit whose turn has come; see the module docstring for the rule."""
        while True:
            for rank, queue in self._queues.items():
                while queue and queue[0].key is None:
                    self._emit((rank,), self._pop(rank))
            heads = {r: q[0] for r, q in self._queues.items() if q}
            if not heads or not self.merge:
                return
            if all(r in heads for r in self.ranks):
                keys = {heads[r].key for r in self.ranks}
                if len(keys) == 1:
                    unit = heads[self.ranks[0]]
                    for r in self.ranks:
                        self._pop(r)
                    self._emit(self.ranks, unit)
                    continue
                # A head that every other rank has further down its queue waits for them to get
                # there, and the others' heads, lines only some ranks printed before it, are shown
                # now. With no such sign (the copies may still be on their way), heads wait out
                # the hold like a lone line.
                waiting = {r for r in self.ranks
                           if all(self._keys.get(o, _NONE)[heads[r].key] > 0 for o in self.ranks if o != r)}
                if len(waiting) == len(self.ranks):
                    ready = list(self.ranks)  # crossed (a b / b a): no order merges them
                elif waiting:
                    ready = [r for r in self.ranks if r not in waiting]
                else:
                    ready = [r for r in self.ranks if final or now - heads[r].since >= MERGE_HOLD_S]
                    if not ready:
                        return
            else:
                ready = [r for r, u in heads.items() if final or now - u.since >= MERGE_HOLD_S]
                if not ready:
                    return
            for r in sorted(ready):
                self._emit((r,), self._pop(r))

    def _emit(self, ranks: tuple[int, ...], unit: _Unit) -> None:
        if unit.kind == "line":
            name, text, continuation = unit.payload
            if self.held.admit(ranks, text):
                self._write(group_label(ranks, self.hosts), name, text, continuation)
        elif unit.kind == "progress":
            name, text = unit.payload
            self._rewrite(ranks[0], name, text)
        elif unit.kind == "rich":
            self._rich(ranks, unit.payload)
        elif unit.kind == "update":
            self._update(ranks[0], unit.payload)
        elif unit.kind == "clear":
            self._end_lines()
            for progress in self._progress.values():
                progress.handle = None  # its display is gone; the next rewrite shows a new one
            # the widget slots are gone too: a view that comes later makes a new row, not an
            # update of a display that is no longer there
            self._widgets = WidgetViews(self.ranks)
            self.held.cleared()
            clear_output(wait=bool(unit.payload.get("wait", False)))
        elif unit.kind == "comm":
            unit.payload()  # publishes a widget's comm message (see comm())
        elif unit.kind == "widget":
            self._widgets.fill(ranks[0], unit.payload, label(ranks[0], self.hosts), self._before_widgets)

    # ------------------------------------------------------------------------------- streams
    def _stream(self, rank: int, name: str, text: str) -> None:
        name = name if name in self._streams else "stdout"
        key = (rank, name)
        # "\r\n" ends a line as "\n" does (a shell command's output, `!pip install`): its "\r" is
        # no progress bar's rewrite, which would have made each line a display of its own
        for piece in _LINES.findall(text.replace("\r\n", "\n")):
            if key in self._partial:
                held, since = self._partial.pop(key)
                piece = held + piece
            else:
                since = time.monotonic()
            if key in self._rewriting or "\r" in piece:
                if piece.endswith("\n"):
                    self._rewriting.discard(key)
                else:
                    self._rewriting.add(key)
                self._continuing.discard(key)
                self._enqueue(rank, "progress", (name, piece), None)
            elif piece.endswith("\n"):
                merge_key = None
                continuation = key in self._continuing
                if continuation:
                    self._continuing.discard(key)  # the rest of a line already shown in part
                elif self._mergeable(rank):
                    merge_key = ("line", name, piece)
                self._enqueue(rank, "line", (name, piece, continuation), merge_key)
            else:
                self._partial[key] = (piece, since)

    def _write(self, who: str, name: str, piece: str, continuation: bool = False) -> None:
        """``piece`` of a line, under the label ``who``; ``continuation``: the rest of a line
        of which a part was already shown (an unfinished line released after its hold)."""
        state = self._streams[name]
        if continuation and piece == "\n" and state.open_line != who:
            # Only the newline of a line that another label's output has ended on screen since:
            # nothing left to end (it would show as an empty labelled line).
            return
        if not self._dirty:
            self.held.reserve()  # the top of the cell's output, before its first line (no-op later)
        out = self._out(name)
        if state.open_line != who:
            prefix = "\n" if state.open_line is not None else ""
            out.write(prefix + who)
        out.write(piece)
        state.open_line = None if piece.endswith("\n") else who

    def _rewrite(self, rank: int, name: str, piece: str) -> None:
        state = self._streams[name]
        if state.open_line is not None:  # a line it had started is being overwritten: close it
            self._out(name).write("\n")
            state.open_line = None
        progress = self._progress.setdefault((rank, name), _Progress())
        done = piece.endswith("\n")
        text = progress.text + piece.rstrip("\n")
        visible = text.rstrip("\r").rsplit("\r", 1)[-1]
        progress.text = visible + ("\r" if text.endswith("\r") else "")
        bundle = {"text/plain": label(rank, self.hosts) + visible}
        if progress.handle is None:
            progress.handle = display(bundle, raw=True, display_id=f"clorch-progress-{next(_ids)}")
        else:
            progress.handle.update(bundle, raw=True)
        if done:
            del self._progress[(rank, name)]

    def _end_lines(self) -> None:
        for name, state in self._streams.items():
            if state.open_line is not None:
                self._out(name).write("\n")
                state.open_line = None

    # ---------------------------------------------------------------------------------- rich
    def _rich(self, ranks: tuple[int, ...], content: dict[str, Any]) -> None:
        self._end_lines()
        self._flush_streams()  # lines before a rich output must reach the notebook first
        who = group_label(ranks, self.hosts)
        data = dict(content.get("data", {}))
        if set(data) - {"text/plain"}:
            sys.stdout.write(who.rstrip() + "\n")  # a label line above plots, tables, HTML
            sys.stdout.flush()
        if "text/plain" in data:
            data["text/plain"] = who + data["text/plain"]
        transient = self._transient(ranks[0], content) if len(ranks) == 1 else None
        if transient is None and len(ranks) == 1:
            transient = self._widgets.shown(ranks[0], data)  # a widget view's: its update finds it
        publish_display_data(data, content.get("metadata") or {}, transient=transient)

    def _before_widgets(self) -> None:
        """Lines before a new row of widget views must reach the notebook first."""
        self._end_lines()
        self._flush_streams()

    def _update(self, rank: int, content: dict[str, Any]) -> None:
        display_id = (content.get("transient") or {}).get("display_id")
        if (rank, display_id) not in self._display_ids and self._widgets.update(rank, content, label(rank, self.hosts)):
            return  # the rank's update of a view it showed without an id (a finished bar): see WidgetViews
        transient = self._transient(rank, content)
        if transient is None:
            return
        data = dict(content.get("data", {}))
        if "text/plain" in data:
            data["text/plain"] = label(rank, self.hosts) + data["text/plain"]
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
