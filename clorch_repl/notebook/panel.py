"""``%clorch top``: a live panel of every rank, updated about once a second, also while a cell runs.

Everything runs on the notebook kernel's main thread, where the relay's sockets live: between
cells a timer on the kernel's event loop ticks the panel, and while a cell runs the relay's wait
loop does (:meth:`Relay.add_tick`). A tick never waits for a rank: it reads the answers that came
since the last tick, redraws, and asks again (:meth:`Prober.send`/:meth:`Prober.collect`, on
sockets of the panel's own, :meth:`Relay.new_prober`). So a rank that holds its GIL delays its own
row, never the cell's output, and the panel shows it as not answering.

Each question is the probe the hang check uses, answered by the rank's control thread while its
main thread runs a cell: the flight recorder's group status and the rank's usage
(:mod:`clorch_repl.diagnosis.usage`), well under a millisecond of a rank's time. Only when a
rank's collective has stood still for :data:`DETAIL_AFTER_S` is that rank asked once for its whole
record (20-30 ms), to name the collective; and when one stands still past the stuck mark, every
rank, for the hang verdict.

The panel follows the notebook's session, not one set of ranks: it is given a way to find the
session (``source``), and after ``%clorch restart``, ``%clorch stop`` then ``%clorch start``, or a
detached session's connect, it asks the new ranks (a restart used to leave it at "the ranks
stopped" with an empty table for good). What it shows of the session it reads from the session's
read-only view (:meth:`Session.view`, :mod:`.view`); of the relay it uses only its probe sockets and
its tick.

The panel is an ipywidgets HTML widget where ipywidgets is installed (JupyterLab, Notebook 7 and
VS Code render it; its button closes it), else a display updated in place
(``update_display_data``), which front ends without a widget manager show as a text table. Closed,
it costs nothing: no timer, no tick, no question.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from ..diagnosis.analyse import analyse
from ..diagnosis.entries import RankEvidence, age_at, op_at, progress
from ..session.lifecycle import SessionState
from ..session.panel_view import STUCK_AFTER_S, Collective, RankSnapshot, render
from ..session.view import SessionView

logger = logging.getLogger(__name__)

__all__ = ["Panel", "snapshot", "snapshot_once", "first_answers", "INTERVAL_S", "CPU_SAMPLE_S"]

INTERVAL_S = 1.0
#: A rank's CPU share is its CPU time since it was last asked; a first question has no earlier one
#: (the rank said "0 %" for a busy rank). The first look asks twice, this far apart: see first_answers.
CPU_SAMPLE_S = 0.4
DETAIL_AFTER_S = 2.0
#: A rank whose answer is older than this is shown as not answering.
SILENT_AFTER_S = 3.0
ONCE_WITHIN_S = 0.8


class Tracker:
    """What the rounds remember: the latest answers, when each pending collective was first seen,
    the collectives' ops once asked, and the hang verdict."""

    def __init__(self) -> None:
        self.answers: dict[int, tuple[float, dict[str, Any]]] = {}
        self.first_seen: dict[tuple[int, str, int], float] = {}
        self.ops: dict[tuple[int, str, int], str | None] = {}
        self.verdict: str | None = None
        self.verdict_at = float("-inf")

    def pending(self, rank: int, answer: dict[str, Any] | None, now: float) -> tuple[str, int, float] | None:
        """The rank's longest-pending collective (group key, seq, age), or None."""
        seen = progress(answer) if answer is not None else None
        marks = seen.marks if seen is not None else ()
        found = None
        live = set()
        for key, enqueued, completed in marks:
            if enqueued > completed:
                seq = completed + 1
                live.add((rank, key, seq))
                first = self.first_seen.setdefault((rank, key, seq), now)
                if found is None or now - first > found[2]:
                    found = (key, seq, now - first)
        for stale in [k for k in self.first_seen if k[0] == rank and k not in live]:
            self.first_seen.pop(stale, None)
            self.ops.pop(stale, None)
        return found


def snapshot(view: SessionView, tracker: Tracker, now: float | None = None) -> tuple[list[RankSnapshot], bool]:
    """Every rank's row of the session's ``view`` (asked with its last log lines) and the tracker's
    latest answers; and whether a collective is stuck."""
    now = time.monotonic() if now is None else now
    snaps, stuck = [], False
    for rank in view.ranks:
        got = tracker.answers.get(rank.rank)
        answer = got[1] if got is not None and now - got[0] <= SILENT_AFTER_S else None
        collective = None
        pending = tracker.pending(rank.rank, answer, now) if rank.alive and answer is not None else None
        if pending is not None:
            key, seq, age = pending
            collective = Collective(group=key, seq=seq, op=tracker.ops.get((rank.rank, key, seq)), age_s=age)
            stuck = stuck or age >= STUCK_AFTER_S
        running = rank.cell  # a stuck rank's too
        snaps.append(RankSnapshot(
            rank=rank.rank, host=rank.host, alive=rank.alive, busy=rank.busy, exit=rank.exit,
            cell=running[0] if running else None, cell_for_s=now - running[1] if running else None,
            last_line=rank.last_line, usage=(answer or {}).get("usage"), collective=collective,
            answered=answer is not None or not rank.alive, line_now=line_now(answer) if running else None))
    return snaps, stuck


def suspended_note(view: SessionView) -> str | None:
    """"suspended: 20.0 GiB of GPU memory held in host memory ..." while the session's ranks are
    suspended (or being suspended or resumed), else None. The ranks are not asked then: a rank's
    answer queries its CUDA stream, which waits until the resume (clorch_repl.session.suspend)."""
    if view.state in (SessionState.SUSPENDING, SessionState.SUSPENDED, SessionState.RESUMING):
        return f"{view.state.value}: {view.why}" if view.why else view.state.value
    return None


def line_now(answer: dict[str, Any] | None) -> str | None:
    """The cell's line a rank runs now, from its probe answer's stack (innermost frame of a
    cell): ``line 4: dist.barrier()``; None where not known (no answer, or library code only)."""
    for frame in reversed((answer or {}).get("stack") or []):
        if frame.get("cell") and not frame.get("library"):
            code = str(frame.get("code") or "").strip()
            return f"line {frame.get('line')}" + (f": {code}" if code else "")
    return None


def _hang_verdict(view: SessionView, whole: dict[int, Any]) -> str | None:
    """The hang verdict's sentence from every rank's whole answer (a dead rank's exit instead),
    None when the ranks are not hung: the live panel's and ``--once``'s."""
    verdict = analyse([RankEvidence(r.rank, answer=whole.get(r.rank), host=r.host) if r.alive
                       else RankEvidence(r.rank, dead=r.exit, host=r.host) for r in view.ranks])
    return verdict.sentence if verdict.hang else None


def first_answers(prober: Any, ranks: list[int], pause_s: float = CPU_SAMPLE_S) -> dict[int, Any]:
    """The ranks' first answers (light, with usage), their CPU share measured over ``pause_s``:
    a rank's CPU figure covers the time since it was last asked, and a rank never asked before (a
    new session, a restart) has no baseline and answered 0 % however busy it was. So the first
    question only starts the interval, and the answers shown are the second's, ``pause_s`` later.
    A rank that did not answer the first is not asked again (it shows as not answering)."""
    first = prober.ask(ranks, light=True, usage=True, timeout_s=ONCE_WITHIN_S)
    answered = [r for r in ranks if first.get(r) is not None]
    if not answered:
        return first
    time.sleep(pause_s)
    return {**first, **prober.ask(answered, light=True, usage=True, timeout_s=ONCE_WITHIN_S)}


def snapshot_once(session: Any) -> tuple[list[RankSnapshot], str | None, str | None]:
    """Every rank's row, asked once (``%clorch top --once``), on sockets of its own; the note to
    show above them (suspended ranks are not asked); and the hang verdict. Where a collective is
    pending, the ranks' whole records are asked too: the live panel learns the op, the age and the
    verdict over its rounds, one look must read them from the records (the entry's own time).
    The CPU column is measured over :data:`CPU_SAMPLE_S` (:func:`first_answers`): ``--once`` takes
    that long, and shows a true share rather than the 0 % of a question with no earlier one."""
    view = session.view()
    note = suspended_note(view)
    prober = session.relay.new_prober()
    try:
        tracker = Tracker()
        answers = {} if note else first_answers(prober, view.alive)
        now = time.monotonic()
        tracker.answers.update({r: (now, a) for r, a in answers.items() if a is not None})
        pending = {r: tracker.pending(r, a, now) for r, (_, a) in tracker.answers.items()}
        if any(pending.values()):
            whole = prober.ask(view.alive, timeout_s=ONCE_WITHIN_S)
            for rank, found in pending.items():
                if found is not None:
                    ident = (rank, found[0], found[1])
                    tracker.ops[ident] = op_at(whole.get(rank), found[0], found[1])
                    age = age_at(whole.get(rank), found[0], found[1])
                    if age is not None:
                        tracker.first_seen[ident] = now - age
            tracker.verdict = _hang_verdict(view, whole)
        snaps, stuck = snapshot(session.view(last_lines=True), tracker, now)
        return snaps, note, tracker.verdict if stuck else None
    finally:
        prober.close()


class Panel:
    """The live panel of the notebook's session: :meth:`start` shows it and starts ticking,
    :meth:`close` stops. ``source`` finds the session now (None while there is none): the panel
    follows it through restarts, stops and starts."""

    def __init__(self, source: Callable[[], Any], interval_s: float = INTERVAL_S,
                 show: Callable[[dict[str, str]], Any] | None = None) -> None:
        self.source = source
        self.session: Any = source()
        self.interval_s = interval_s
        self._show = show
        self._relay: Any = None
        self._connections = 0
        self._prober: Any = None
        self._tracker = Tracker()
        #: every question still open: msg_id -> rank, and msg_id -> what it asked
        self._waiting: dict[str, int] = {}
        self._kind: dict[str, str] = {}
        self._whole_answers: dict[int, dict[str, Any]] = {}
        self._next = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._update: Callable[[dict[str, str]], None] | None = None
        self.rounds = 0
        self.open = False

    def start(self) -> None:
        snaps, note = self._attach()
        self._update = self._display(render(snaps, note=note))
        self.open = True
        self._next = time.monotonic() + self.interval_s
        try:
            self._loop = asyncio.get_running_loop()  # the kernel's, between cells
        except RuntimeError:
            self._loop = None  # a terminal IPython: the panel updates while cells run only
        self._arm()

    def _attach(self) -> tuple[list[RankSnapshot], str | None]:
        """Ask the session's current ranks, on sockets of the panel's own; their first rows, and
        the note above them (suspended ranks are not asked). Their CPU is measured over
        :data:`CPU_SAMPLE_S` (:func:`first_answers`), so the first draw shows a true share."""
        self._relay = self.session.relay  # its sockets: the panel's own prober and its tick
        self._connections = getattr(self._relay, "connections", 0)  # a replaced rank: asked anew
        self._prober = self._relay.new_prober()
        self._tracker, self._waiting, self._kind, self._whole_answers = Tracker(), {}, {}, {}
        view = self.session.view()
        note = suspended_note(view)
        first = {} if note else first_answers(self._prober, view.alive)
        now = time.monotonic()
        self._tracker.answers.update({r: (now, a) for r, a in first.items() if a is not None})
        self._relay.add_tick(self.tick)
        return snapshot(self.session.view(last_lines=True), self._tracker, now)[0], note

    def _detach(self) -> None:
        """Let go of ranks that are gone (a stop, a restart): their relay and the sockets."""
        if self._relay is not None:
            self._relay.remove_tick(self.tick)
        if self._prober is not None:
            self._prober.close()
        self._relay = self._prober = None

    def _follow(self) -> bool:
        """Whether the session's ranks are the ones the panel asks; if not, let go of the old
        ones and take up the new (drawn at once), or say there are none. Never waits long: the
        first question to new ranks is bounded by ONCE_WITHIN_S."""
        session = self.source()
        relay = session.relay if session is not None else None
        if relay is self._relay and getattr(relay, "connections", 0) == self._connections:
            return relay is not None  # the same ranks; or still none (said when they went)
        self._detach()
        self.session = session
        if relay is None:
            self._update(render([], None, note="no ranks running: the panel follows the next %clorch start"))
            return False
        snaps, note = self._attach()
        self._update(render(snaps, None, note=note or "new ranks"))
        return False

    def _arm(self) -> None:
        if self._loop is not None and self.open:
            self._timer = self._loop.call_later(self.interval_s / 2, self._on_timer)

    def _on_timer(self) -> None:
        try:
            self.tick()
        finally:
            self._arm()

    def tick(self) -> None:
        """One round if one is due: read what came, redraw, ask again. Never waits."""
        now = time.monotonic()
        if not self.open or now < self._next:
            return
        self._next = now + self.interval_s
        try:
            if self._follow():
                self._round(now)
        except Exception:  # noqa: BLE001 - a panel's trouble must not fail the cell it updates during
            logger.exception("%%clorch top stopped updating")
            self.close("stopped after an error; see the notebook kernel's log")

    def _ask(self, ranks: list[int], kind: str, **options: Any) -> None:
        sent = self._prober.send(ranks, **options)
        self._waiting.update(sent)
        self._kind.update({msg_id: kind for msg_id in sent})

    def _open(self, kind: str) -> set[int]:
        """The ranks with a question of ``kind`` still open."""
        return {self._waiting[m] for m, k in self._kind.items() if k == kind and m in self._waiting}

    def _round(self, now: float) -> None:
        tracker = self._tracker
        view = self.session.view(last_lines=True)
        note = suspended_note(view)
        if note:  # nothing asked of suspended ranks: say so instead
            self._update(render(snapshot(view, tracker, now)[0], None, note=note))
            return
        asked = dict(self._waiting)
        for msg_id, answer in self._prober.collect(self._waiting).items():
            rank, kind = asked[msg_id], self._kind.pop(msg_id)
            if kind == "light":
                tracker.answers[rank] = (now, answer)
            elif kind == "detail":
                for ident in [k for k in tracker.first_seen if k[0] == rank and tracker.ops.get(k) is None]:
                    tracker.ops[ident] = op_at(answer, ident[1], ident[2])
            else:
                self._whole_answers[rank] = answer
        snaps, stuck = snapshot(view, tracker, now)
        alive = view.alive
        if not stuck:
            tracker.verdict = None
        elif self._whole_answers and not self._open("whole"):
            tracker.verdict = _hang_verdict(view, self._whole_answers)
            self._whole_answers = {}
        if stuck and not self._open("whole") and now - tracker.verdict_at >= STUCK_AFTER_S:
            self._ask(alive, "whole")  # every rank's whole record, for the verdict
            tracker.verdict_at = now
        detailing = self._open("detail")
        for snap in snaps:  # name a collective that stands still, once
            c = snap.collective
            if c is not None and c.op is None and c.age_s >= DETAIL_AFTER_S and snap.rank not in detailing \
                    and (snap.rank, c.group, c.seq) not in tracker.ops:
                tracker.ops[(snap.rank, c.group, c.seq)] = None
                self._ask([snap.rank], "detail")
        light = self._open("light")
        self._ask([r for r in alive if r not in light], "light", light=True, usage=True)
        self.rounds += 1
        self._update(render(snaps, tracker.verdict))

    def close(self, note: str = "closed") -> None:
        """Stop ticking, draw the last table with ``note``, let go of the sockets."""
        if not self.open:
            return
        self.open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            if self._relay is not None and self.session is not None and self.session.relay is self._relay \
                    and self._update is not None:
                snaps, _ = snapshot(self.session.view(last_lines=True), self._tracker)
                self._update(render(snaps, None, note=note))
            elif self._update is not None:
                self._update(render([], None, note=note))
        finally:
            self._detach()

    def _display(self, bundle: dict[str, str]) -> Callable[[dict[str, str]], None]:
        if self._show is not None:
            self._show(bundle)
            return self._show
        try:
            import ipywidgets
        except ImportError:
            ipywidgets = None
        from IPython.display import display

        if ipywidgets is None:
            handle = display(bundle, raw=True, display_id=True)
            return lambda b: handle.update(b, raw=True)
        table = ipywidgets.HTML(value=bundle["text/html"])
        button = ipywidgets.Button(description="close", layout=ipywidgets.Layout(width="80px"))
        button.on_click(lambda _b: self.close())
        box = ipywidgets.VBox([table, button])
        # A front end without a widget manager (nbclient, a console) shows the bundle's text, which
        # for a widget is its repr, "VBox(children=...)": give it the table instead.
        display({**box._repr_mimebundle_(), "text/plain": bundle["text/plain"], "text/html": bundle["text/html"]},
                raw=True)

        def update(b: dict[str, str]) -> None:
            table.value = b["text/html"]
        return update
