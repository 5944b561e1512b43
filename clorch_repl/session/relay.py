"""The channels of a session: sends cells to ranks and turns what comes back into protocol values.

One thread (the caller's) polls every rank's iopub, shell and stdin sockets (a rank's prompts,
see :mod:`.stdin`) with a single ``zmq.Poller``, so output streams live from all ranks at once
with no relay threads to leak. A cell's wait always ends: when every rank has finished (its reply read, and every
iopub message the reply counts, see ``wire.IOPUB_COUNT_KEY``), when a rank's process dies (seen within a
fraction of a second), at the cell's time limit, or after an interrupt plus a grace period, after
which a rank that has not returned is reported as stuck together with its Python stack.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Callable, Protocol

import zmq
from jupyter_client.blocking.client import BlockingKernelClient

from ..diagnosis import render
from ..diagnosis.analyse import Progress, RankState, Verdict, analyse, progress
from ..diagnosis.probe import PROBE_TIMEOUT_S, Prober
from ..errors import ClorchError
from ..rank_sets import rank_words
from . import cell_end, flood
from .cell_files import CellNames
from .comms import COMM_TYPES
from ..launchers.base import Launcher
from .protocol import CellOutcome, CellRequest, RankError, RankOutcome, RankOutput, Status
from .stdin import NO_STDIN_KEY, FrontEnd, StdinBroker
from ..errors import SignatureError
from .wire import (CELL_NUMBER_KEY, COUNTED_KEY, IOPUB_COUNT_KEY, LEAN_KEY, OUTPUT_LIMITS_KEY, MessageDecoder,
                   MessageEncoder)

logger = logging.getLogger(__name__)

#: Message types forwarded to the display as they arrive.
OUTPUT_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result", "clear_output"})
#: How long ranks get to return after an interrupt before they are reported stuck.
INTERRUPT_GRACE_S = 5.0
#: After a rank dies or raises mid-cell, how long the others may finish on their own before they
#: are interrupted: in SPMD code they are most likely waiting for it in a collective, which would
#: otherwise hold them until the process group's timeout (torchelastic stops the rest likewise).
FAILURE_GRACE_S = 2.0
#: How often the processes are checked for death while waiting.
LIVENESS_PERIOD_S = 0.2
#: A rank's part of a cell ends once its execute_reply (shell) and every iopub message the reply
#: counts (wire.IOPUB_COUNT_KEY) have been read, or on its idle status (a request ipykernel's own
#: path answered); failing both, once the reply has come, when nothing more of the cell arrived
#: from it for REPLY_QUIET_S: iopub drops messages past ZeroMQ's high-water mark, while the shell
#: reply is never dropped. Output still in flight when the reply comes is counted by it, so it is
#: read while it keeps coming (a finished cell's backlog is finite); a message that never comes
#: no longer wedges the cell. The quiet period is generous because a rank's display output
#: leaves through its IOPub thread, which a loaded machine can hold back behind the reply (the
#: reply comes from the main thread): a short one would drop the end of a cell that succeeded.
#: It costs nothing when every counted message arrives, which is every time but after a flood.
REPLY_QUIET_S = 3.0
#: A cell cut short (time limit, interrupt) is not drained further: it ends this long after the
#: reply, whatever is still queued (see ``_drop``).
REPLY_DRAIN_S = 0.5
#: The drain after a reply never lasts longer than this, even while output keeps coming (a
#: thread the cell started, printing under the cell's header, after a lost idle status).
REPLY_DRAIN_MAX_S = 10.0
#: At most this many messages are read from one socket per pass, so that a rank flooding its
#: iopub neither starves the other sockets (its shell reply included) nor the cell's deadlines.
PUMP_BATCH = 256
#: Per rank, how many abandoned requests are remembered so that their late output is dropped. An
#: entry goes once its reply and every message the reply counts (or its idle status) came; one
#: whose messages were lost (the flood case) would stay for ever, so only the most recent are
#: kept: a backlog older than that many cells is long gone.
ABANDONED_KEPT = 64
#: While a collective is pending but younger than the hang notice, how often to look again.
HANG_RECHECK_S = 1.0
#: How long an interrupt waits for the ranks to say where they were before it is sent.
INTERRUPT_PROBE_S = 1.0


class OutputSink(Protocol):
    """Where a cell's output goes as it arrives (the notebook display, or a test's list)."""

    def output(self, item: RankOutput) -> None: ...

    def flush(self, final: bool = False) -> None:
        """Called after each burst of messages, and with ``final`` once the cell has ended (and
        before a rank's prompt opens, so that what the rank printed first is shown first)."""


class _Discard:
    def output(self, item: RankOutput) -> None:
        pass

    def flush(self, final: bool = False) -> None:
        pass


@dataclass
class _Wait:
    """Book-keeping of one cell while its ranks run."""

    msg_ids: dict[int, str]
    pending: set[int]
    outcome: CellOutcome
    sink: OutputSink
    deadline: float | None = None          # the cell's own time limit
    give_up_at: float | None = None        # end of the grace period after an interrupt
    failed_at: float | None = None         # when the first rank died or raised
    interrupted_ranks: set[int] = field(default_factory=set)
    last_progress: float = field(default_factory=time.monotonic)  # last output of any rank
    next_hang_check: float | None = None   # None: the hang notice is off, or was given
    #: where each rank's collectives stood at the last hang check (analyse.Progress), per rank
    collectives_seen: dict[int, Progress] = field(default_factory=dict)
    diagnosis: str | None = None           # taken before the first interrupt, for the report
    hurry: bool = False                    # interrupted twice: ask the ranks nothing more
    replied_at: dict[int, float] = field(default_factory=dict)  # execute_reply arrival, per rank
    #: ranks whose end of the cell was confirmed: their reply and every iopub message it counts
    #: read (wire.IOPUB_COUNT_KEY), or their idle status
    finished: set[int] = field(default_factory=set)
    expected: dict[int, int] = field(default_factory=dict)  # iopub messages the reply counted, per rank
    received: dict[int, int] = field(default_factory=dict)  # counted iopub messages read, per rank
    heard: dict[int, float] = field(default_factory=dict)  # last iopub message of the cell, per rank
    stdin: StdinBroker | None = None       # the ranks' prompts (see clorch_repl.session.stdin)
    #: the notebook's own guard on what each rank's output of the cell forwards (flood.backstop)
    guard_limits: flood.Limits = field(default_factory=flood.Limits)
    guards: dict[int, flood.Budget] = field(default_factory=dict)


class Relay:
    """Owns one jupyter_client channel set per rank and runs cells over them."""

    def __init__(self, group: Launcher) -> None:
        self.group = group
        self.clients: dict[int, BlockingKernelClient] = {}
        self.poller = zmq.Poller()
        self._owner: dict[Any, tuple[int, str]] = {}
        #: msg_id of the request each rank is still executing (None when idle as far as we know)
        self.running: dict[int, str | None] = {}
        self._ready: dict[int, set[str]] = {}
        #: output of an abandoned cell that arrived between cells, shown with the next one
        self._late: list[RankOutput] = []
        self._decoders: dict[int, MessageDecoder] = {}
        self._encoders: dict[int, MessageEncoder] = {}
        self._rejected = 0
        #: per rank, msg_ids of cells whose wait ended before they were finished (timed out,
        #: stuck, drained after the reply): their later output is dropped, not shown elsewhere.
        #: Each with [iopub messages read, the count its reply gave or None] (see _Wait.finished)
        self._abandoned: dict[int, dict[str, list[int | None]]] = {}  # insertion-ordered, see ABANDONED_KEPT
        #: per rank, [messages, bytes] of such output dropped since the last notice
        self._dropped: dict[int, list[int]] = {}
        self.prober = Prober()
        #: called from a cell's wait loop every LIVENESS_PERIOD_S, on this thread: what must run
        #: while a cell runs and use sockets (%clorch top, clorch_repl.session.panel); none waits
        self.ticks: list[Callable[[], None]] = []
        #: where the ranks' comm messages go (the session's CommBridge.from_rank); None drops them
        self.comm_sink: Callable[[int, dict[str, Any]], None] | None = None
        #: per rank, the msg_id of a request that is no cell (a front end's comm message) being settled
        self._settling: dict[int, str] = {}
        #: where a rank's debug_event goes (%clorch debugger: the DebugForwarder's); None drops them
        self.debug_sink: Callable[[int, dict[str, Any]], None] | None = None
        #: ranks the debugger panel has paused (stopped, not yet continued): held, not hung
        self.debug_paused: set[int] = set()
        #: the running cell's prompts (clorch_repl.session.stdin); the diagnosis names ranks at one
        self._stdin: StdinBroker | None = None
        #: the notebook's cells, to name them in the ranks' faulthandler stacks (see stack_of)
        self.cell_names = CellNames()

    # ----------------------------------------------------------------- connection and readiness
    def connect(self, progress: Callable[[int, int], None], timeout_s: float = 120.0) -> None:
        """Open channels to every rank and wait until each answers on shell and iopub."""
        for proc in self.group.ranks:
            client = proc.client()
            client.start_channels(shell=True, iopub=True, stdin=True, hb=False, control=False)
            self.clients[proc.rank] = client
            self._decoders[proc.rank] = MessageDecoder(client.session)
            self._encoders[proc.rank] = MessageEncoder(client.session)
            self.prober.add(proc.rank, client, self._decoders[proc.rank])
            self.running[proc.rank] = None
            self._ready[proc.rank] = set()
            for kind in ("iopub", "shell", "stdin"):
                sock = getattr(client, f"{kind}_channel").socket
                self.poller.register(sock, zmq.POLLIN)
                self._owner[sock] = (proc.rank, kind)
        total = len(self.clients)
        deadline = time.monotonic() + timeout_s
        last_probe: dict[int, float] = {}
        reported = -1
        while True:
            ready = [r for r, seen in self._ready.items() if seen >= {"iopub", "shell"}]
            if len(ready) != reported:
                reported = len(ready)
                progress(reported, total)
            if reported == total:
                return
            for proc in self.group.ranks:
                if not proc.alive:
                    raise ClorchError(
                        f"{proc.where} exited while starting ({proc.exit}); "
                        f"its log ends with:\n{self.group.log_tail(proc.rank, 20)}")
            now = time.monotonic()
            if now > deadline:
                late = sorted(set(self.clients) - set(ready))
                tails = "\n".join(f"rank {r}'s log ends with:\n{self.group.log_tail(r, 10)}" for r in late)
                raise ClorchError(f"{rank_words(late)} did not answer within {timeout_s:.0f} s of starting\n{tails}")
            for rank in self.clients:
                if rank not in ready and now - last_probe.get(rank, 0.0) > 0.5:
                    # Repeated until iopub hears it too: the first may be published before our
                    # subscription is in place (ZeroMQ's slow joiner).
                    self.clients[rank].kernel_info()
                    last_probe[rank] = now
            for sock, _ in self.poller.poll(100):
                rank, kind = self._owner[sock]
                channel = getattr(self.clients[rank], f"{kind}_channel")
                while True:
                    try:
                        channel.get_msg(timeout=0)
                    except Empty:
                        break
                    self._ready[rank].add(kind)

    # ----------------------------------------------------------------------------- execution
    def new_prober(self) -> Prober:
        """A prober of every rank with sockets and signature checks of its own, for a thread other
        than the relay's (``%clorch top``): ZeroMQ sockets and the replay check are per thread."""
        prober = Prober()
        for rank, client in self.clients.items():
            prober.add(rank, client, MessageDecoder(client.session))
        return prober

    def busy(self) -> list[int]:
        """Ranks still executing an earlier request (after draining what has arrived)."""
        self._pump(None, 0)
        return [r for r, msg_id in self.running.items() if msg_id is not None]

    def execute(self, request: CellRequest, sink: OutputSink | None = None, *, silent: bool = False,
                interrupt_grace_s: float = INTERRUPT_GRACE_S) -> CellOutcome:
        """Run ``request`` on its ranks at once and wait, streaming output to ``sink``.

        KeyboardInterrupt while waiting (Kernel > Interrupt in the notebook) interrupts the ranks
        and keeps waiting for the grace period; a second one stops waiting at once.
        """
        sink = sink or _Discard()
        if request.cell_number is not None and not silent:
            self.cell_names.add(request.code, request.cell_number, request.ranks)
        for item in self._late:
            sink.output(item)
        self._late.clear()
        outcome = CellOutcome(ranks={r: RankOutcome(r) for r in request.ranks}, interrupt_grace_s=interrupt_grace_s)
        wait = _Wait(msg_ids={}, pending=set(request.ranks), outcome=outcome, sink=sink)
        if request.timeout_s is not None:
            wait.deadline = time.monotonic() + request.timeout_s
        wait.guard_limits = flood.backstop(request.output_limits)
        front, no_front = (None, "clorch_repl's own requests read no input") if silent else FrontEnd.current()
        wait.stdin = StdinBroker(front, lambda rank, value: self.clients[rank].input(value))
        for rank in request.ranks:
            msg_id = self._send_execute(rank, request, silent, front is not None, no_front)
            wait.msg_ids[rank] = msg_id
            self.running[rank] = msg_id
        self._stdin = wait.stdin
        try:
            self._wait(request, wait, interrupt_grace_s)
        finally:
            self._stdin = None
            self._watch_front(front, False)
        return outcome

    def _watch_front(self, front: FrontEnd | None, on: bool) -> None:
        """Poll the front end's stdin socket (for the answer) only while a prompt is open there."""
        if front is None or (front.socket in self._owner) == on:
            return
        if on:
            self.poller.register(front.socket, zmq.POLLIN)
            self._owner[front.socket] = (-1, "front")
        else:
            self.poller.unregister(front.socket)
            del self._owner[front.socket]

    def _send_execute(self, rank: int, request: CellRequest, silent: bool, front: bool, no_front: str) -> str:
        """Send the cell to one rank; allow_stdin only where its prompts can reach the front end
        (see clorch_repl.session.stdin); otherwise the rank's kernel raises with the reason."""
        client = self.clients[rank]
        allowed = front and (request.stdin_ranks is None or rank in request.stdin_ranks)
        content = dict(code=request.code, silent=silent, store_history=not silent, user_expressions={},
                       allow_stdin=allowed, stop_on_error=False)
        metadata: dict[str, Any] = {LEAN_KEY: True}
        if request.output_limits is not None:
            metadata[OUTPUT_LIMITS_KEY] = request.output_limits.to_wire()
        if request.cell_number is not None and not silent:
            metadata[CELL_NUMBER_KEY] = int(request.cell_number)
        if not allowed:
            why = no_front if not front else (
                f"only {rank_words(request.stdin_ranks or ())} may read input in this cell "
                f"(%%distributed --stdin-ranks); add rank {rank} there to answer its prompts from the notebook")
            metadata[NO_STDIN_KEY] = f"input() on rank {rank}: {why}"
        msg_id, frames = self._encoders[rank].request("execute_request", content, metadata)
        client.shell_channel.socket.send_multipart(frames)
        return msg_id

    def _wait(self, request: CellRequest, wait: _Wait, interrupt_grace_s: float) -> None:
        outcome, sink = wait.outcome, wait.sink
        next_liveness = time.monotonic() + LIVENESS_PERIOD_S
        if request.hang_notice_s > 0:
            wait.next_hang_check = time.monotonic() + request.hang_notice_s
        while wait.pending:
            try:
                now = time.monotonic()
                failure_deadline = None if wait.failed_at is None else wait.failed_at + FAILURE_GRACE_S
                limits = [next_liveness] + [t for t in (wait.deadline, wait.give_up_at, failure_deadline,
                                                        wait.next_hang_check) if t is not None]
                limits += [self._drain_end(wait, r) for r in wait.replied_at if r in wait.pending]
                prompt_due = wait.stdin.next_step() if wait.stdin is not None else None
                if prompt_due is not None:
                    limits.append(prompt_due)
                self._pump(wait, max(0.0, min(limits) - now))
                sink.flush()
                if wait.stdin is not None:
                    if wait.stdin.step(wait.pending, lambda: sink.flush(final=True)):
                        wait.last_progress = time.monotonic()  # the user answered a prompt: progress
                    self._watch_front(wait.stdin.front, wait.stdin.open is not None)
                now = time.monotonic()
                self._end_replied(wait, now)
                if now >= next_liveness:
                    self._check_deaths(wait, now)
                    next_liveness = now + LIVENESS_PERIOD_S
                    for tick in list(self.ticks):  # %clorch top, on this thread (it never waits)
                        tick()
                if wait.next_hang_check is not None and now >= wait.next_hang_check and wait.pending:
                    self._check_hang(wait, request.hang_notice_s)
                if (wait.failed_at is not None and wait.pending and wait.give_up_at is None
                        and now - wait.failed_at >= FAILURE_GRACE_S):
                    self._interrupt(wait, interrupt_grace_s)
                if wait.deadline is not None and now >= wait.deadline and not outcome.timed_out:
                    outcome.timed_out = True
                    self._interrupt(wait, interrupt_grace_s)
                if wait.give_up_at is not None and now >= wait.give_up_at:
                    self._give_up(wait)
            except KeyboardInterrupt:
                self._on_keyboard_interrupt(wait, interrupt_grace_s)
        self._finish(wait)
        sink.flush(final=True)

    def _on_keyboard_interrupt(self, wait: _Wait, grace_s: float) -> None:
        """Kernel > Interrupt while waiting: interrupt the ranks and keep waiting for the grace
        period. A second one stops waiting at once, also when it lands while the first is still
        asking the ranks where they are (up to INTERRUPT_PROBE_S): from then on nothing more is
        asked (no probe, no stacks), so the cell ends now and its wait is finished properly."""
        again = wait.outcome.interrupted or wait.give_up_at is not None
        wait.outcome.interrupted = True
        wait.hurry = wait.hurry or again
        try:
            self._interrupt(wait, grace_s)
            if again:
                self._give_up(wait)
        except KeyboardInterrupt:
            wait.hurry = True
            self._interrupt(wait, grace_s)
            self._give_up(wait)

    def _interrupt(self, wait: _Wait, grace_s: float) -> None:
        wait.next_hang_check = None  # being interrupted: the report will say why instead
        if wait.diagnosis is None and wait.pending and not wait.hurry:
            # Before the interrupt moves anything: where each rank was while it was stuck. Briefly:
            # the interrupt waits for it.
            wait.diagnosis = self._diagnosis_text(timeout_s=INTERRUPT_PROBE_S)
        if wait.outcome.timed_out and wait.outcome.diagnosis is None:
            wait.outcome.diagnosis = wait.diagnosis
        targets = sorted(wait.pending - wait.interrupted_ranks)
        if targets:
            self.group.interrupt(targets)
            wait.interrupted_ranks.update(targets)
        if wait.give_up_at is None:
            wait.give_up_at = time.monotonic() + grace_s

    def _give_up(self, wait: _Wait) -> None:
        """Stop waiting for ranks that did not return; say where each one is stuck."""
        if wait.pending and wait.outcome.diagnosis is None and not wait.hurry:
            wait.outcome.diagnosis = wait.diagnosis or self._diagnosis_text(timeout_s=INTERRUPT_PROBE_S)
        wait.outcome.cut_short = wait.outcome.cut_short or (wait.hurry and bool(wait.pending))
        alive = [r for r in sorted(wait.pending) if self.group.ranks[r].alive]
        answers = {} if wait.hurry or not alive else self.prober.ask(alive, light=True, timeout_s=INTERRUPT_PROBE_S)
        for rank in sorted(wait.pending):
            result = wait.outcome.ranks[rank]
            result.stack = "" if wait.hurry else self.stack_of(rank)
            if not wait.hurry and cell_end.returned(answers.get(rank), result.stack):
                # It returned; its reply is still on its way (behind its output): not stuck, and
                # free for the next cell (what it still sends of this one is dropped, see _finish).
                result.status, result.stack = Status.RETURNED, None
                if self.running.get(rank) == wait.msg_ids.get(rank):
                    self.running[rank] = None
                continue
            result.status = Status.STUCK
        wait.pending.clear()

    def _check_deaths(self, wait: _Wait, now: float) -> None:
        for rank in sorted(wait.pending):
            proc = self.group.ranks[rank]
            if proc.alive:
                continue
            self._pump(wait, 0)  # keep what it said before it died
            result = wait.outcome.ranks[rank]
            result.status = Status.DIED
            result.exit = proc.exit if not proc.host or proc.host in (proc.exit or "") else f"{proc.exit}, on {proc.host}"
            result.log_tail = self.cell_names.name(self.group.death_report(rank), rank)
            wait.pending.discard(rank)
            self.running[rank] = None
            if wait.failed_at is None:
                wait.failed_at = now
                if wait.pending and wait.outcome.diagnosis is None:
                    # The others most likely wait for it: say so while they still do.
                    wait.outcome.diagnosis = wait.diagnosis = self._diagnosis_text()

    def _pump(self, wait: _Wait | None, timeout_s: float) -> None:
        """Receive what arrives within ``timeout_s`` on any rank's channels and route it.

        Returns after one pass over the ready sockets, at most :data:`PUMP_BATCH` messages from
        each, so that the caller checks its deadlines and deaths between passes under a flood.
        Shell frames are decoded too: their execute_reply ends a rank's cell (see
        :data:`REPLY_DRAIN_S`)."""
        for sock, _ in self.poller.poll(int(timeout_s * 1000)):
            rank, kind = self._owner[sock]
            if kind == "front":  # the front end's answer: read by the cell's stdin broker
                continue
            for _ in range(PUMP_BATCH):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = self._decoders[rank].decode(frames)
                except SignatureError as exc:
                    self._rejected += 1
                    if self._rejected == 1:
                        warnings.warn(f"clorch_repl: dropped a message from rank {rank}: {exc}", RuntimeWarning,
                                      stacklevel=2)
                    continue
                if kind == "shell":
                    self._on_reply(rank, msg, wait)
                elif kind == "stdin":
                    self._on_input_request(rank, msg, wait)
                else:
                    self._route(rank, msg, wait)

    def _on_reply(self, rank: int, msg: dict[str, Any], wait: _Wait | None) -> None:
        """A shell reply: an execute_reply says the rank finished the request (see REPLY_DRAIN_S);
        its error, if any, stands in for an iopub error message that may have been dropped."""
        if msg["msg_type"] != "execute_reply":
            return
        parent_id = msg["parent_header"].get("msg_id")
        count = msg["metadata"].get(IOPUB_COUNT_KEY)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            count = None  # ipykernel's own path answered: its idle status ends the rank's part
        mine = wait is not None and wait.msg_ids.get(rank) == parent_id
        if mine and count is not None:
            wait.expected[rank] = count  # also for a rank no longer waited for: see _finish
        if mine and rank in wait.pending:
            wait.replied_at.setdefault(rank, time.monotonic())
            content = msg["content"]
            result = wait.outcome.ranks[rank]
            if content.get("status") == "error" and result.error is None:
                self._record_error(wait, rank, content)
            if count is not None and wait.received.get(rank, 0) >= count:
                self._finished(wait, rank, parent_id)
            return
        if parent_id is not None and parent_id == self.running.get(rank):
            self.running[rank] = None  # an abandoned cell's request is done: the rank is free
        entry = self._abandoned.get(rank, {}).get(parent_id or "")
        if entry is not None and count is not None:
            entry[1] = count
            if entry[0] >= count:  # nothing more comes of it
                del self._abandoned[rank][parent_id]

    def _finished(self, wait: _Wait, rank: int, msg_id: str | None) -> None:
        """``rank`` has sent all it will of the cell: its part is over (see _Wait.finished)."""
        if msg_id == self.running.get(rank):
            self.running[rank] = None
        wait.pending.discard(rank)
        wait.finished.add(rank)

    def _on_input_request(self, rank: int, msg: dict[str, Any], wait: _Wait | None) -> None:
        """A rank asks for a line: the running cell's broker serves it. With no cell running (a
        thread of an earlier cell), no one can answer: end-of-file, rather than a rank that hangs."""
        if msg["msg_type"] != "input_request":
            return
        if wait is not None and wait.stdin is not None and rank in wait.pending:
            wait.stdin.request(rank, msg)
            wait.last_progress = time.monotonic()
            return
        logger.warning("rank %d asked for input outside a cell; answered with end-of-file", rank)
        self.clients[rank].input("\x04")

    def _drain_end(self, wait: _Wait, rank: int) -> float:
        """When a rank whose reply came but whose idle status did not stops being waited for."""
        at = wait.replied_at[rank]
        if wait.give_up_at is not None:  # cut short: its backlog is not shown
            return at + REPLY_DRAIN_S
        return min(max(at, wait.heard.get(rank, at)) + REPLY_QUIET_S, at + REPLY_DRAIN_MAX_S)

    def _end_replied(self, wait: _Wait, now: float) -> None:
        """End the part of every rank whose reply came and whose drain is over (see
        :data:`REPLY_DRAIN_S`): what it still sends for this cell is dropped (see :meth:`_finish`)."""
        for rank in list(wait.replied_at):
            if rank in wait.pending and now >= self._drain_end(wait, rank):
                wait.pending.discard(rank)
                if self.running.get(rank) == wait.msg_ids.get(rank):
                    self.running[rank] = None

    def _finish(self, wait: _Wait) -> None:
        """The cell's wait is over: requests that did not finish are abandoned (their
        later output is dropped and counted, see :meth:`_drop`); say once what was dropped."""
        self.debug_paused.difference_update(wait.msg_ids)  # a rank whose cell ended is not paused in it
        for rank, msg_id in wait.msg_ids.items():
            if rank not in wait.finished:
                abandoned = self._abandoned.setdefault(rank, {})
                abandoned[msg_id] = [wait.received.get(rank, 0), wait.expected.get(rank)]
                while len(abandoned) > ABANDONED_KEPT:  # the idle of the oldest was lost: forget it
                    del abandoned[next(iter(abandoned))]
        for rank, guard in sorted(wait.guards.items()):
            line = flood.withheld_line(rank, guard)
            if line is not None:
                wait.sink.output(RankOutput(rank, "stream", {"name": "stderr", "text": line}))
        for rank in sorted(self._dropped):
            count, size = self._dropped.pop(rank)
            wait.sink.output(RankOutput(rank, "stream", {"name": "stderr", "text": (
                f"(clorch_repl: dropped {count} late output message(s), {size / 1024:.0f} KiB, of an "
                f"earlier cell that was cut short or whose end was never confirmed; the rank's log has them: "
                f"%clorch logs {rank})\n")}))

    def _drop(self, rank: int, content: dict[str, Any]) -> None:
        """Output of an abandoned cell, arriving after its wait ended, is dropped and counted.

        Why not show it, labelled late, in whichever cell runs next: it belongs to a cell the
        user has already been told was cut short, mixing it into another cell's output makes
        that cell's output wrong, and under a flood there can be megabytes of it. Nothing is
        lost: the rank's log holds all of it, and the next cell ends with one line saying how
        much was dropped and where to read it."""
        counts = self._dropped.setdefault(rank, [0, 0])
        counts[0] += 1
        counts[1] += len(str(content.get("text", ""))) + len(str(content.get("data", "")))

    def _record_error(self, wait: _Wait, rank: int, content: dict[str, Any]) -> None:
        result = wait.outcome.ranks[rank]
        result.error = RankError(rank, content.get("ename", ""), content.get("evalue", ""),
                                 tuple(content.get("traceback", ())))
        result.status = Status.INTERRUPTED if result.error.ename == "KeyboardInterrupt" else Status.ERROR
        if result.status is Status.ERROR and wait.failed_at is None:
            wait.failed_at = time.monotonic()

    def _route(self, rank: int, msg: dict[str, Any], wait: _Wait | None) -> None:
        """One iopub message: routed (:meth:`_route_one`), and, when the rank counted it
        (wire.COUNTED_KEY), counted against the count its request's reply gives
        (wire.IOPUB_COUNT_KEY), which ends the rank's part once reached."""
        parent_id = msg["parent_header"].get("msg_id")
        self._route_one(rank, msg, wait)
        if not msg["metadata"].get(COUNTED_KEY):
            return
        if wait is not None and parent_id is not None and wait.msg_ids.get(rank) == parent_id:
            wait.received[rank] = got = wait.received.get(rank, 0) + 1
            if rank in wait.pending and got >= wait.expected.get(rank, got + 1):
                self._finished(wait, rank, parent_id)
            return
        entry = self._abandoned.get(rank, {}).get(parent_id or "")
        if entry is not None:
            entry[0] = (entry[0] or 0) + 1
            if entry[1] is not None and entry[0] >= entry[1]:  # nothing more comes of it
                del self._abandoned[rank][parent_id]

    def _route_one(self, rank: int, msg: dict[str, Any], wait: _Wait | None) -> None:
        msg_type = msg["header"]["msg_type"]
        parent_id = msg["parent_header"].get("msg_id")
        content = msg["content"]
        if msg_type == "status":
            if content.get("execution_state") == "idle":
                if wait is not None and wait.msg_ids.get(rank) == parent_id:
                    self._finished(wait, rank, parent_id)
                elif parent_id == self.running.get(rank):
                    self.running[rank] = None
                self._abandoned.get(rank, {}).pop(parent_id, None)  # nothing more comes of it
                if self._settling.get(rank) == parent_id:
                    del self._settling[rank]
            return
        if msg_type == "debug_event":  # JupyterLab's debugger on a rank (clorch_repl.session.debugger)
            event = content.get("event")
            if event == "stopped":
                self.debug_paused.add(rank)
                if wait is not None:
                    wait.last_progress = time.monotonic()
            elif event in ("continued", "terminated", "exited"):
                self.debug_paused.discard(rank)
            if self.debug_sink is not None:
                self.debug_sink(rank, msg)
            return
        if msg_type in COMM_TYPES:  # widgets: never dropped, whichever request they belong to
            self._comm(rank, msg, wait)
            return
        if msg_type in OUTPUT_TYPES and parent_id in self._abandoned.get(rank, {}):
            self._drop(rank, content)
            return
        if wait is None:
            if msg_type in OUTPUT_TYPES:
                self._late.append(RankOutput(rank, msg_type, content))
            return
        if wait.msg_ids.get(rank) == parent_id:
            wait.heard[rank] = time.monotonic()
        if msg_type in OUTPUT_TYPES:
            # Output of an earlier cell that ended normally (a thread it started) is shown too.
            wait.last_progress = now = time.monotonic()
            guard = wait.guards.get(rank)
            if guard is None:
                guard = wait.guards[rank] = flood.Budget(wait.guard_limits, now)
            if msg_type == "clear_output" or guard.admit_size(*flood.message_size(msg_type, content), now):
                wait.sink.output(RankOutput(rank, msg_type, content))
        elif msg_type == "error" and wait.msg_ids.get(rank) == parent_id:
            self._record_error(wait, rank, content)

    def _comm(self, rank: int, msg: dict[str, Any], wait: _Wait | None) -> None:
        """A rank's comm message (a widget's): to the comm sink, through the cell's display when
        one runs, so that it keeps its place among the rank's output (see clorch_repl.session.comms)."""
        if self.comm_sink is None:
            return
        deliver = functools.partial(self.comm_sink, rank, msg)
        queue = getattr(wait.sink, "comm", None) if wait is not None else None
        if wait is not None:
            wait.last_progress = time.monotonic()  # a widget bar moving is progress: no hang notice
            if wait.msg_ids.get(rank) == msg["parent_header"].get("msg_id"):
                wait.heard[rank] = wait.last_progress
        if queue is not None:
            queue(rank, deliver)
        else:
            deliver()

    def settle(self, rank: int, msg_id: str, timeout_s: float) -> bool:
        """Between cells: route what the ranks send until ``rank``'s idle status for ``msg_id`` (a
        request that is no cell, e.g. a front end's comm message), at most ``timeout_s``; False if
        it did not come (the rest is routed at the next read)."""
        self._settling[rank] = msg_id
        deadline = time.monotonic() + timeout_s
        try:
            while self._settling.get(rank) == msg_id:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pump(None, left)
            return True
        finally:
            if self._settling.get(rank) == msg_id:
                del self._settling[rank]

    def pump_between_cells(self, late_limit: int) -> None:
        """Between cells: route what has arrived, without waiting, so that widget traffic of a
        rank's thread reaches the front end live (clorch_repl.session.comms calls this from the
        notebook kernel's event loop). Output meanwhile waits for the next cell as before; while
        ``late_limit`` pieces of it wait, nothing is read and ZeroMQ's queues hold the rest."""
        if len(self._late) < late_limit:
            self._pump(None, 0)

    # ----------------------------------------------------------------------------- diagnosis
    def diagnose(self, ranks: list[int] | None = None, *, all_threads: bool = False,
                 fallback: bool = True, timeout_s: float = PROBE_TIMEOUT_S,
                 unanswered: set[int] | None = None) -> tuple[Verdict, list[RankState]]:
        """Ask the ranks where they are (over control, while they run) and line the answers up.

        A rank that does not answer within ``timeout_s`` (native code holding its GIL) is shown
        with its faulthandler stack when ``fallback`` is set. Ranks in ``unanswered`` have just
        failed to answer a question: they are not asked again (each would cost the wait again)."""
        ranks = [p.rank for p in self.group.ranks] if ranks is None else ranks
        alive = [r for r in ranks if self.group.ranks[r].alive and r not in (unanswered or ())]
        answers = self.prober.ask(alive, all_threads=all_threads, timeout_s=timeout_s)
        states = []
        for rank in ranks:
            proc = self.group.ranks[rank]
            if not proc.alive:
                states.append(RankState(rank, dead=proc.exit, host=proc.host))
                continue
            state = RankState(rank, answer=answers.get(rank), host=proc.host,
                              prompt=self._stdin.prompts.get(rank) if self._stdin is not None else None,
                              paused=rank in self.debug_paused)
            if not state.answered and fallback:
                state.fallback_stack = self.stack_of(rank)
            states.append(state)
        return analyse(states), states

    def stack_of(self, rank: int) -> str:
        """Where ``rank``'s main thread is now, from its faulthandler (answers while native code
        holds its GIL), its cells named as the notebook shows them (``Cell In[12], line 3``)."""
        return self.cell_names.name(self.group.dump_stack(rank), rank)

    def _diagnosis_text(self, timeout_s: float = PROBE_TIMEOUT_S) -> str:
        verdict, states = self.diagnose(timeout_s=timeout_s)
        return render.report(verdict, states)

    def _check_hang(self, wait: _Wait, notice_s: float) -> None:
        """No output for ``notice_s``: say why, once, if a collective has been pending as long."""
        now = time.monotonic()
        if now - wait.last_progress < notice_s:
            wait.next_hang_check = wait.last_progress + notice_s
            wait.collectives_seen.clear()  # output came: the next check starts a quiet stretch afresh
            return
        may_hang, unanswered = self._may_hang(wait)
        if not may_hang:
            wait.next_hang_check = time.monotonic() + max(HANG_RECHECK_S, notice_s / 4)
            return
        verdict, states = self.diagnose(fallback=False, unanswered=unanswered)
        if verdict.stuck and (verdict.pending_s or 0.0) >= notice_s:
            silent = [s for s in states if not s.answered and s.dead is None]
            if silent:
                # A rank whose native code holds its GIL (NCCL's .item() or synchronize() may) cannot
                # answer; the others' records still show the collective it is not in. Name it from
                # its faulthandler stack, without asking everyone again.
                for state in silent:
                    state.fallback_stack = self.stack_of(state.rank)
                verdict = analyse(states)
            text = render.notice(verdict)
            wait.next_hang_check = None  # first: an interrupt landing while it prints must not repeat it
            notify = getattr(wait.sink, "notice", None)
            if notify is not None:
                notify(text)
            else:
                warnings.warn(text, RuntimeWarning, stacklevel=2)
            return
        wait.next_hang_check = time.monotonic() + max(HANG_RECHECK_S, notice_s / 4)

    def _may_hang(self, wait: _Wait) -> tuple[bool, set[int]]:
        """The periodic check's first question, for the flight recorder's group status only
        (``light``): whether some rank may have had a collective pending since the last check
        (analyse.Progress.stood_still; at the first check of a quiet stretch, pending is
        enough, so that check answers as fully as before). A training loop that is merely quiet
        keeps moving, so its ranks are not asked for their whole flight record every few
        seconds: that costs each rank 20-30 ms of CPU with its GIL held on gloo, 70 ms and more
        on NCCL (over 100 ms with a full garbage collection), the status well under 1 ms.
        Also returns the ranks that did not answer (native code holding their GIL), so that
        the whole question does not wait for them a second time."""
        alive = [p.rank for p in self.group.ranks if p.alive]
        answers = self.prober.ask(alive, light=True)
        still = False
        for rank, answer in answers.items():
            before = wait.collectives_seen.pop(rank, None)
            now = progress(answer) if answer is not None else None
            if now is not None:
                wait.collectives_seen[rank] = now
                still = still or now.stood_still(before)
        return still, {rank for rank, answer in answers.items() if answer is None}

    def close(self) -> None:
        self.prober.close()
        for client in self.clients.values():
            for kind in ("iopub", "shell", "stdin"):
                try:
                    self.poller.unregister(getattr(client, f"{kind}_channel").socket)
                except (KeyError, AttributeError):
                    pass
            client.stop_channels()
        self.clients.clear()
        self._owner.clear()
