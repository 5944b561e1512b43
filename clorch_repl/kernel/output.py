"""A rank's output on its way to the notebook: the cell's output budget and ``RankOutStream``.

Imported on a rank only, by ipykernel when it builds the kernel's streams (the
``outstream_class`` option in :data:`clorch_repl.kernel.app.KERNEL_OPTIONS`), so ipykernel is
imported here at module level: the notebook's process never loads this module.

* The budget (:mod:`clorch_repl.wire.limits`): what a cell may publish; what it refuses goes to
  the rank's log only, and a report at the cell's end (a display of flood.HELD_MIME, which the
  notebook reads into the one line at the top of the cell's output) says how much was held back.
  The kernel opens and closes it around each cell (:func:`start_cell`, :func:`end_cell`).
* The pace (:mod:`.pace`): a thread printing held-back output in a tight loop, on a host whose
  cores are all busy, pauses now and then, so that a runaway print loop leaves the cores to the
  notebook, its server and its browser.
* ``RankOutStream``: ipykernel's stream, minus work that a flood of output would multiply, with
  ``\r`` progress updates coalesced before they are published.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from ipykernel.iostream import OutStream

from ..common.ctrl_c import ctrl_c_deferred
from ..wire.limits import Budget, Limits, held_display
from .child_flush import CHILD_FLUSH
from .pace import Pace
from .tracebacks import interrupts_at_users_line

logger = logging.getLogger(__name__)

#: A user's flush of a line that only rewrote the current line (``\r``) within this long of the
#: last send is left to the stream's own timed flush (ipykernel's flush_interval, 0.2 s).
COALESCE_S = 0.1
#: True while a cell's code runs; outside it (the kernel's own flush at a cell's end) every
#: flush is done, so nothing of a cell is published after the cell's reply.
_in_cell = False
#: when the user's latest cell began (see cell_began_ns); None before the first
_cell_began_ns: int | None = None
#: the rank's stream written to last (RankOutStream._after_the_other)
_last_stream: "RankOutStream | None" = None
#: The messages switches of streams may send: a burst of SWITCH_BURST, then SWITCH_RATE a second.
#: Each costs the writing thread about 0.1 ms on the 2-core box (a cell alternating stdout and
#: stderr every line sent a message a line: 400 for 200 alternations, 100-200 us an alternation
#: against 17-30 us coalesced), so a sustained alternation costs at most about 5 % of a core. A
#: cell's few switches (a warning, then a print) always keep their order.
SWITCH_BURST = 100
SWITCH_RATE = 500.0
_switch_tokens = float(SWITCH_BURST)
_switch_at = 0.0
#: This rank's output budget for the running (or last) cell (clorch_repl.wire.limits): what it
#: refuses goes to the rank's log only. One for stdout and stderr together, shared by the cell's
#: threads (hence the lock); kept after the cell, so a thread the cell left printing stays bounded.
_budget: Budget | None = None
_budget_lock = threading.Lock()
#: the process whose cells the budget is for, taken as each cell starts, not at import: a rank
#: forked from the zygote (clorch_repl.host.zygote) imported this module there, and a child it
#: forks (a DataLoader worker) publishes through its own pipe, unbudgeted
_budget_pid = os.getpid()
#: when a thread printing held-back output in a tight loop pauses (see .pace); one per cell
_pace = Pace()


def _admit(string: str) -> bool:
    """Whether the cell's budget lets ``string`` be published (it is echoed to the log either way)."""
    __tracebackhide__ = True  # a KeyboardInterrupt landing here is the user's print's, not ours
    budget = _budget
    if budget is None or os.getpid() != _budget_pid:
        return True
    with _budget_lock:
        return budget.admit(string, time.monotonic())


def _held_pause() -> None:
    """A write was held back: pause the writing thread if it prints in a tight loop (see .pace),
    so that a runaway print loop leaves the cores to the notebook, its server and its browser."""
    __tracebackhide__ = True  # a KeyboardInterrupt landing in the pause is the user's print's
    with _budget_lock:
        pause = _pace.held(threading.get_ident(), time.monotonic(), _not_queued)
    if pause > 0:
        time.sleep(pause)


def _not_queued() -> float:
    """A clock of this thread that stands still only while it waits on a run queue for a core:
    the monotonic clock less that wait (Linux's ``/proc/thread-self/schedstat``, its second field,
    in ns). The pace asks whether the thread got a core, and a thread blocked on I/O, the GIL or
    a GPU's sync did not want one: its CPU time alone would count those as waits for a core.
    Where schedstat cannot be read, the thread's CPU time."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as stat:
            queued_ns = int(stat.read().split()[1])
    except (OSError, IndexError, ValueError):
        return time.thread_time()
    return time.monotonic() - queued_ns / 1e9


def _start_budget(limits: Limits, silent: bool = False) -> None:
    """A cell starts: a fresh budget. What the last one held after its cell's report (a thread
    that cell left printing) is reported first, so that nothing is held back unannounced; by the
    next cell of the user's when this one is ``silent`` (clorch_repl's own request: a join, a
    transfer, whose output is not where a user looks for a notice about an earlier cell)."""
    global _budget, _pace, _budget_pid
    with _budget_lock:
        previous, _budget, _pace = _budget, None, Pace()
        _budget_pid = os.getpid()
    fresh = Budget(limits, time.monotonic())
    report = None
    if previous is not None and silent:
        fresh.carry_late(previous)
    elif previous is not None:
        report = previous.late_report(os.environ.get("RANK", "?"))
    try:
        _publish_report(report)
    finally:
        with _budget_lock:
            _budget = fresh


def _publish_report(report: dict | None) -> None:
    """A held-back report, as a display (flood.held_display) in the request's output."""
    if report is None:
        return
    from IPython.core.getipython import get_ipython

    shell = get_ipython()
    if shell is None:
        logger.warning("no shell to publish the held-back report to: %s", report)
        return
    shell.display_pub.publish(held_display(report), metadata={})


def _publish_held_back() -> None:
    """At the cell's end: the report of what this rank held back (before the streams' last
    flush, so that the reply counts it). Published whatever the budget says."""
    global _budget
    with _budget_lock:
        budget, _budget = _budget, None
    if budget is None:
        return
    report = budget.held_report(os.environ.get("RANK", "?"))
    budget.mark_announced()  # published with the cell's output (a transfer's too): said once
    try:
        _publish_report(report)
    finally:
        with _budget_lock:
            if _budget is None:
                _budget = budget


def _echo(echo: object, string: str) -> None:
    """To the rank's log, as ipykernel's own echo does (its errors to the real stderr)."""
    if echo is not None:
        try:
            echo.write(string)  # type: ignore[attr-defined]
        except OSError as exc:
            print(f"Write failed: {exc}", file=sys.__stderr__)



# Coalescing edits ipykernel 7's per-parent buffers (``_buffers``, filled by ``write`` and
# emptied by ``_flush_buffers``) in place. An ipykernel built otherwise (the package pins 7,
# but a site may force another) gets ipykernel's own writes: correct, only not coalesced.
_COALESCING = all(hasattr(OutStream, name) for name in ("_is_master_process", "_flush_buffers"))


def in_cell() -> bool:
    """Whether a cell's code runs now (:func:`clorch_repl.diagnosis.probe.cell_frames` asks)."""
    return _in_cell


def cell_began_ns() -> int | None:
    """When the running cell (or the last one) began, by ``time.time_ns`` (the flight recorder's
    clock): a probe tells the notebook which collectives are this cell's, so that a death report
    does not blame a collective that ended before it (the session's start-up barrier, say)."""
    return _cell_began_ns


def start_cell(limits: Limits, silent: bool) -> None:
    """A cell starts: a fresh budget (see :func:`_start_budget`), and the streams in cell mode."""
    global _in_cell, _cell_began_ns
    _start_budget(limits, silent)
    _in_cell = True
    if not silent:  # (clorch's own requests are no cell of the user's)
        _cell_began_ns = time.time_ns()


def end_cell() -> None:
    """The cell's code returned: every flush is done again, and the held-back line is said."""
    global _in_cell
    _in_cell = False
    _publish_held_back()


class RankOutStream(OutStream):
    """ipykernel's stream, minus work that a flood of output would multiply.

    * A flush of a stream nothing was written to is skipped: ipykernel flushes stdout and
      stderr around every cell, and each flush from the main thread waits for two hops
      through the IOPub thread, over a millisecond per cell here.
    * A flush returns once its text has been handed to the iopub socket (see ``flush``).
    * ``\r`` progress updates are coalesced: a write whose last ``\r`` starts a rewrite of
      the current line replaces what the buffer still holds of that line (the notebook shows
      only a progress line's last state anyway), and while a cell runs, a user's flush of
      nothing but such rewrites within :data:`COALESCE_S` of the last send is left to the
      timed flush that every write schedules. A tqdm with ``mininterval=0`` then publishes
      about ten messages a second instead of one per update: 300,000 flushed updates used
      to be 300,000 iopub messages, past ZeroMQ's high-water mark, and the relay lost
      messages. The rank's log still gets every write (the echo happens first).
    """

    _clean = False
    _rewrite_only = False
    _last_send = 0.0
    #: written to since its last send (:meth:`_after_the_other` sends nothing for a stream without)
    _unsent = False

    def write(self, string: str) -> int | None:
        __tracebackhide__ = True  # see _admit
        self._clean = False
        if string:
            self._after_the_other()
            self._unsent = True
        # A "\r" rewrite of the current line is not counted: coalescing (below) already bounds
        # what it publishes to about ten messages a second, and the bar's last state must show.
        rewrite = isinstance(string, str) and "\r" in string and "\n" not in string
        if isinstance(string, str) and string and not rewrite and not _admit(string):
            _echo(self.echo, string)  # held back: the rank's log still gets it (see flood)
            _held_pause()
            return len(string)
        child = (_COALESCING and isinstance(string, str) and self.pub_thread is not None
                 and not self._is_master_process())
        if child and "\n" not in string:
            return self._hold_in_child(string)
        if not isinstance(string, str) or self.pub_thread is None or not _COALESCING or child:
            return super().write(string)  # its errors, and forked children's lines, as ipykernel does them
        p = string.rfind("\r")
        if p < 0 or p + 1 == len(string) or "\n" in string[p:]:
            self._rewrite_only = False
            nl = string.rfind("\n")
            with self._buffer_lock:
                key = frozenset(self.parent_header.items())
                result = super().write(string)
                if nl >= 0:
                    buf = self._buffers[key]
                    self._line_starts[key] = (buf, buf.tell() - (len(string) - nl - 1))
            return result
        _echo(self.echo, string)
        with self._buffer_lock:
            key = frozenset(self.parent_header.items())
            buf = self._buffers[key]
            nl = string.rfind("\n", 0, p)
            if nl >= 0:
                buf.write(string[:nl + 1])  # lines it completes are kept
                self._rewrite_only = False
                start = buf.tell()
            else:
                owner, start = self._line_starts.get(key, (None, 0))
                if owner is not buf:
                    start = 0
            buf.seek(start)
            buf.truncate()
            buf.write(string[p:])
            self._line_starts[key] = (buf, start)
        self._schedule_flush()
        return len(string)

    write = interrupts_at_users_line(write, __file__)  # Ctrl-C in a print ends at the user's line

    def _hold_in_child(self, string: str) -> int:
        """In a forked child (a Pool's or a DataLoader's worker), text that ends no line is kept
        for the line's end. ipykernel sends each of a child's writes at once as a message of its
        own (a child has no IOPub thread to time a flush, and may be ended without one), and
        ``print`` writes a line's text and its end apart: the lines of workers printing at once
        reached the notebook run together ("worker 2 line 0worker 3 line 0"), their ends as
        empty lines of their own. The text goes with the next write that ends a line (ipykernel
        sends what the buffer holds), with an explicit flush (``print(..., flush=True)`` flushes
        after the end; tqdm flushes every update), or at most :data:`.child_flush.HOLD_S` later
        as it is (a line that never ends, a bare ``write``). Two writes say that no more of the
        line is coming, and send what is held at once, so that a worker ended right after them
        (``with Pool()`` terminates its workers) loses nothing: an empty one (the last write of
        ``print(..., end="")``) and one that ends with ``"\\r"`` (a progress update's, or
        ``print(..., end="\\r")``'s)."""
        if string:
            _echo(self.echo, string)  # the rank's log gets it now, as ipykernel's write would
            with self._buffer_lock:
                self._buffers[frozenset(self.parent_header.items())].write(string)
        if not string or string.endswith("\r"):
            self._flush()  # the send itself, as ipykernel's write does in a child
        else:
            CHILD_FLUSH.held(self)
        return len(string)

    def _after_the_other(self) -> None:
        """Before this stream takes text, what the other one still buffers is sent: each stream
        sends on its own timer, and a cell's end flushes stdout before stderr, so a warning or a
        log line written before a print reached the notebook after it (``sys.stderr.write('a')``
        then ``print('b')`` showed b, then a, on every rank). The other stream's text is taken and
        handed to the IOPub thread here, in the writing thread: a flush merely scheduled on that
        thread ran late and sent this stream's later text with its own, ahead of the other's (seen
        in 7 of 30 cells). Only a switch of streams costs this: one message, as a flush would, at
        most :data:`SWITCH_RATE` a second after a burst of :data:`SWITCH_BURST` (a switch from a
        stream with nothing unsent costs nothing and counts for nothing). Streams that alternate
        faster (a line to each, thousands a second) are coalesced per stream as ipykernel coalesces
        them, their interleaving lost, rather than sent as a message a line."""
        global _last_stream, _switch_tokens, _switch_at
        other, _last_stream = _last_stream, self
        if (other is None or other is self or not other._unsent or other.pub_thread is None
                or not _COALESCING or not self._is_master_process()):
            return
        now = time.monotonic()
        _switch_tokens = min(SWITCH_BURST, _switch_tokens + (now - _switch_at) * SWITCH_RATE)
        _switch_at = now
        if _switch_tokens >= 1:
            _switch_tokens -= 1
            # ipykernel rotates its buffers under their lock (safe beside its thread); a Ctrl-C
            # between taking the text and handing it over would lose it: raised once it is sent
            with ctrl_c_deferred() as deferred:
                other._flush()
            if deferred.came:
                raise KeyboardInterrupt

    @property
    def _line_starts(self) -> dict:
        starts = self.__dict__.get("_clorch_line_starts")
        if starts is None:
            starts = self.__dict__["_clorch_line_starts"] = {}
        return starts

    def _flush(self) -> None:
        self._unsent = False
        super()._flush()
        self._last_send = time.monotonic()
        self._rewrite_only = True

    def flush(self) -> None:
        if self._clean:
            return
        if (self._rewrite_only and _in_cell and time.monotonic() - self._last_send < COALESCE_S
                and self._is_master_process()):  # (a forked child has no timed flush: it sends now)
            return  # a timed flush is scheduled (every write schedules one)
        self._clean = True
        thread = self.pub_thread
        if (thread is None or thread.thread is None or not thread.thread.is_alive()
                or thread.thread.ident == threading.get_ident()):
            super().flush()  # ipykernel sends at once in these cases
            return
        # ipykernel's flush waits until the IOPub thread has taken the text from the buffer,
        # but the send itself is queued behind that, for the thread's next round: a cell that
        # then holds the GIL in native code (``print('x', flush=True); sum(range(10**11))``)
        # kept its flushed output from the notebook until it let go. Wait for that round
        # too: the thread runs it on its own, so this costs no extra wake-up.
        done = threading.Event()
        thread.schedule(self._flush)
        thread.schedule(lambda: thread.schedule(done.set))
        if not done.wait(self.flush_timeout):
            print("IOStream.flush timed out", file=sys.__stderr__)
