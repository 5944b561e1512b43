"""Runs cells on the ranks: the I/O that carries out what a cell's state machine decides.

The parts, each with the one thing it owns: :mod:`.channels` the sockets, :mod:`.ledger` which
request each message belongs to (across cells), :mod:`.cell_run` one cell's book-keeping and
policy (when a rank's part is over, when to interrupt, when to give up), :mod:`.hang_watch` the
hang notice, :mod:`.sink` the contract with what shows the output, :mod:`.waited` the cell waited
for and what other threads may do to it (ask for its interrupt, nothing else), and
:mod:`.rank_questions` where the ranks are. The relay feeds the first's
messages to the second and third and does what they answer: sends interrupts, asks the ranks
where they are, reads deaths, serves prompts. A cell's wait always ends: when every rank has
finished, when a rank's process dies (seen within a fraction of a second), at the cell's time
limit, or after an interrupt plus a grace period (and the abort of the group, see .group_abort),
after which a rank that has not returned is reported as stuck together with its Python stack.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable

from jupyter_client.blocking.client import BlockingKernelClient

from ..diagnosis.probe import Prober
from ..errors import ClorchError
from ..launchers.base import Launcher
from ..wire.framing import utc_date
from .cell_files import CellNames
from .cell_run import INTERRUPT_GRACE_S, REPLY_QUIET_S, CellRun, FreeGroup, GiveUp, Interrupt
from .channels import Channels
from .group_abort import Freed, free_group
from .hang_watch import HangWatch
from .ledger import CommMessage, DebugEvent, EndOfFile, Effect, InputRequest, Ledger, Show
from .protocol import CellOutcome, CellRequest, Status
from ..common.ctrl_c import ctrl_c_deferred
from .sink import OutputSink, PlainSink, complete_sink
from .hooks import NoStdin, StdinHook, stdin_of
from .stdin import StdinBroker
from .cell_request import StartedCell, packed_request
from .rank_questions import AsksRanks
from .waited import WaitedCell

logger = logging.getLogger(__name__)

__all__ = ["INTERRUPT_GRACE_S", "INTERRUPT_PROBE_S", "LIVENESS_PERIOD_S", "REPLY_QUIET_S", "OutputSink", "Relay",
           "StartedCell"]

#: How often the processes are checked for death while waiting.
LIVENESS_PERIOD_S = 0.2
#: How long an interrupt waits for the ranks to say where they were before it is sent.
INTERRUPT_PROBE_S = 1.0

RankSink = Callable[[int, dict[str, Any]], None]


class Relay(AsksRanks):
    """Runs cells over the ranks' channels (see the module docstring)."""

    def __init__(self, launcher: Launcher) -> None:
        self._launcher = launcher
        self.channels = Channels(launcher)
        self.ledger = Ledger()
        self._prober: Prober = self.channels.prober
        #: called from a cell's wait loop every LIVENESS_PERIOD_S, on this thread: what must run
        #: while a cell runs and use sockets (%clorch top, clorch_repl.notebook.panel); none waits
        self._ticks: list[Callable[[], None]] = []
        #: where the ranks' comm messages go (see set_comm_sink); None drops them
        self._comm_sink: RankSink | None = None
        #: where a rank's debug_event goes (%clorch debugger: see set_debug_sink); None drops them
        self._debug_sink: RankSink | None = None
        #: the cell waited for, its prompts (clorch_repl.session.stdin) and sink; and the one
        #: thing other threads may do (see .waited: nothing else here is theirs to call)
        self._waited = WaitedCell()
        #: the notebook's cells, to name them in the ranks' faulthandler stacks (see stack_of)
        self.cell_names = CellNames()
        #: how often channels were opened (a replaced rank's are new: %clorch top asks again)
        self.connections = 0

    # ----------------------------------------------------------------- what others may ask
    def client(self, rank: int) -> BlockingKernelClient | None:
        """``rank``'s channels, or None when it has none (the session is stopping)."""
        return self.channels.clients.get(rank)

    @property
    def connected(self) -> bool:
        return bool(self.channels.clients)

    def idle(self, rank: int) -> bool:
        """Whether ``rank`` runs no request of ours, as far as what has been read says."""
        return self.ledger.idle(rank)

    def down(self, rank: int) -> str | None:
        """Why ``rank``'s process is not running (its exit), or None while it is."""
        proc = self._launcher.ranks[rank]
        return None if proc.alive else (proc.exit or "gone")

    def add_tick(self, tick: Callable[[], None]) -> None:
        """Call ``tick`` from a cell's wait loop every LIVENESS_PERIOD_S, on this thread (what must
        run while a cell runs and uses sockets: %clorch top); it must never wait."""
        if tick not in self._ticks:
            self._ticks.append(tick)

    def remove_tick(self, tick: Callable[[], None]) -> None:
        if tick in self._ticks:
            self._ticks.remove(tick)

    def set_comm_sink(self, sink: RankSink | None) -> None:
        """Where the ranks' comm messages (widgets) go: the session's CommBridge.from_rank; None
        drops them (the session is stopping: no widget may reach a closed bridge)."""
        self._comm_sink = sink

    def set_debug_sink(self, sink: RankSink | None) -> None:
        """Where the ranks' debug_events go (%clorch debugger); None: dropped, nobody paused."""
        self._debug_sink = sink
        if sink is None:
            self.ledger.debug_paused.clear()

    @property
    def debug_paused(self) -> frozenset[int]:
        """Ranks the debugger has paused (held, not hung)."""
        return frozenset(self.ledger.debug_paused)

    # ----------------------------------------------------------------------------- channels
    def connect(self, progress: Callable[[int, int], None], timeout_s: float = 120.0,
                ranks: list[int] | None = None, late: tuple[float, Callable[[], None]] | None = None) -> None:
        """Open channels to every rank (or ``ranks``: fresh processes in their place) and wait until
        each answers on shell and iopub (``late``: see Channels.connect)."""
        for proc in self._launcher.ranks:
            if ranks is None or proc.rank in ranks:
                self.ledger.add_rank(proc.rank)
        self.channels.connect(progress, timeout_s, ranks, late)
        self.connections += 1

    def new_prober(self) -> Prober:
        return self.channels.new_prober()

    def free_group(self, ranks: list[int] | tuple[int, ...]) -> Freed:
        """Abort the session's group if every one of ``ranks`` waits in it (see .group_abort); with
        no ranks, at once."""
        return free_group(self._prober, self._launcher, ranks)

    def busy(self) -> list[int]:
        """Ranks still executing an earlier request (after draining what has arrived)."""
        self._pump(0)
        return self.ledger.busy()

    def close(self) -> None:
        self.channels.close()

    # ----------------------------------------------------------------------------- execution
    def execute(self, request: CellRequest, sink: OutputSink | None = None, *, silent: bool = False,
                interrupt_grace_s: float = INTERRUPT_GRACE_S) -> CellOutcome:
        """Run ``request`` on its ranks at once and wait, streaming output to ``sink``.

        KeyboardInterrupt while waiting (Kernel > Interrupt in the notebook) interrupts the ranks
        and keeps waiting for the grace period; a second one stops waiting at once.
        """
        sink = complete_sink(sink)  # refused before anything is sent
        return self.finish(self.begin(request, silent=silent, interrupt_grace_s=interrupt_grace_s), sink)

    def begin(self, request: CellRequest, *, silent: bool = False, interrupt_grace_s: float = INTERRUPT_GRACE_S,
              stdin: StdinHook | NoStdin | None = None) -> StartedCell:
        """Send ``request`` to its ranks and return at once; :meth:`finish` waits for it.

        Between the two nothing is read (the ranks' replies and output wait in ZeroMQ's queues),
        so whatever the caller does meanwhile, the notebook kernel's own handling of the cell
        (clorch_repl.magics.head_start), overlaps the ranks' run without anything being shown
        early or lost. Exactly one cell may be begun and not finished. ``stdin``: what answers the
        ranks' prompts (:mod:`.hooks`; None: nobody, the ranks' ``input()`` raises saying so).

        A Ctrl-C during the sends is held back until every rank has the cell, and then does not
        escape: the handle comes back marked :attr:`StartedCell.interrupted`, and :meth:`finish`
        ends the cell as interrupted. This is the one place an interrupted send is recovered."""
        if self._waited.started is not None:
            # A cell begun and then lost (an interrupt between its send and its wait): end it on the
            # ranks rather than refuse every cell from now on.
            logger.warning("clorch_repl: a cell sent to the ranks was never waited for; interrupting it")
            self.finish(self._waited.started, PlainSink(), interrupted=True)
        if request.cell_number is not None and not silent:
            self.cell_names.add(request.code, request.cell_number, request.ranks)
        if not silent:
            self._launcher.cell_began(request.ranks)
        run = CellRun(request, time.monotonic(), self.ledger.running, interrupt_grace_s)
        run.outcome.world_size = len(self._launcher.ranks)
        if silent:
            stdin = NoStdin("clorch_repl's own requests read no input")
        elif stdin is None:
            stdin = stdin_of(None, None)  # the one wording of "nobody answers"
        front, no_front = (None, stdin.why) if isinstance(stdin, NoStdin) else (stdin, "")
        started = StartedCell(request, run, StdinBroker(front, self.channels.answer))
        self._waited.begin(started)
        try:
            with ctrl_c_deferred() as deferred:
                self._send_all(run, request, silent, front is not None, no_front)
        except BaseException:
            self.finish(started, PlainSink(), interrupted=True)  # the ranks already sent it must not run on
            raise
        if deferred.came:  # every rank has it: finish ends the cell as interrupted
            started = self._waited.started = dataclasses.replace(started, interrupted=True)
        return started

    def finish(self, started: StartedCell, sink: OutputSink | None = None, *,
               interrupted: bool = False) -> CellOutcome:
        """Wait for a cell :meth:`begin` sent, streaming its output to ``sink``; its outcome.
        ``interrupted`` (or the handle's own mark, a Ctrl-C during its send): the notebook's cell
        was interrupted before it came to wait (the ranks are interrupted at once and given the
        grace period, as for Kernel > Interrupt).

        A hook that raises (anything but a KeyboardInterrupt, which interrupts the cell) ends the
        wait there: the cell is abandoned as a timed-out one is (it runs on to its end on the
        ranks, which stay busy till then; its later output is dropped and counted, never given
        to the next cell) and the exception leaves this call."""
        run, stdin = started.run, started.stdin
        interrupted = interrupted or started.interrupted
        if self._waited.run is not run:
            raise ClorchError("this cell was already finished")
        ended = False
        try:
            sink = complete_sink(sink)
            for item in self.ledger.take_late():
                sink.output(item)
            self._waited.sink = sink
            watch = HangWatch(self, run, sink, started.request.hang_notice_s, run.now)
            if interrupted:  # nothing read since the sends: what came first frees the ranks that finished
                try:
                    self._pump(0)
                except KeyboardInterrupt:  # another Ctrl-C as that output is shown: the next is the second
                    run.user_interrupt()
                self._on_keyboard_interrupt(run, watch)
            self._wait(run, watch)
            ended = True
            for item in self.ledger.end(run):
                sink.output(item)
            sink.flush(final=True)
        finally:
            if not ended:  # a hook raised, or the wait was left by force: nothing of it reaches another cell
                logger.info("clorch_repl: the wait for a cell ended early; its output from now on is dropped")
                self.ledger.end(run)
            self._waited.end()
            if stdin.front is not None and stdin.front.socket is not None:
                self.channels.watch(stdin.front.socket, False)
        lost = sorted(o.rank for o in run.outcome.failed if o.status in (Status.DIED, Status.STUCK))
        if lost:  # what the report advises where this session cannot start them again alone
            run.outcome.instead_of_replacing = self._launcher.instead_of_replacing(lost)
        return run.outcome

    def abandon(self, started: StartedCell) -> None:
        """End the wait for ``started`` unwaited (a session hook raised before the wait began): as
        a raising output hook leaves it (see :meth:`finish`). Nothing when it is not waited for."""
        if self._waited.run is started.run:
            self.ledger.end(started.run)
            self._waited.end()

    def owned_here(self) -> bool:
        """Whether the calling thread owns the relay (made it): only it may use anything here but
        :meth:`interrupt_waiting` (see .waited)."""
        return self._waited.owned_here()

    def interrupt_waiting(self, otherwise: Callable[[], None] | None = None) -> bool:
        """From any thread: the cell being waited for is interrupted as Kernel > Interrupt does it
        (ranks interrupted, the grace period, the stuck report) by its waiting loop, within a
        liveness period (True). When none is waited for, ``otherwise`` is called instead, under
        the lock that keeps a cell from beginning meanwhile, and False returned (see .waited)."""
        return self._waited.ask_interrupt(otherwise)

    @property
    def unfinished(self) -> StartedCell | None:
        """The cell begun and not yet finished, if any (nothing is read from the ranks meanwhile)."""
        return self._waited.started

    def _send_all(self, run: CellRun, request: CellRequest, silent: bool, front: bool, no_front: str) -> None:
        """Send the cell to each of its ranks: its content and metadata packed once a cell for the
        ranks allowed stdin and once for the others (wire.NO_STDIN_RANK: the rank puts in its number)."""
        packed: dict[bool, tuple[bytes, bytes]] = {}
        date = utc_date()  # one a cell: the requests are sent within a few milliseconds
        send, sent = self.channels.send, run.sent
        for rank in request.ranks:
            allowed = front and (request.stdin_ranks is None or rank in request.stdin_ranks)
            if allowed not in packed:
                packed[allowed] = packed_request(request, silent, allowed, front, no_front)
            metadata, content = packed[allowed]
            sent(rank, send(rank, "execute_request", metadata, content, date=date))

    def _wait(self, run: CellRun, watch: HangWatch) -> None:
        next_liveness = time.monotonic() + LIVENESS_PERIOD_S
        while not run.over:
            try:
                if self._waited.take_interrupt():
                    self._on_keyboard_interrupt(run, watch)
                next_liveness = self._wait_once(run, watch, next_liveness)
            except KeyboardInterrupt:
                self._on_keyboard_interrupt(run, watch)

    def _wait_once(self, run: CellRun, watch: HangWatch, next_liveness: float) -> float:
        """One pass: read until the next thing is due, then do what is due; the next liveness check."""
        stdin, sink = self._waited.stdin, self._waited.sink
        assert stdin is not None
        now = time.monotonic()
        limits = [next_liveness] + run.wake_at()
        for due in (watch.next_check, stdin.next_step()):
            if due is not None:
                limits.append(due)
        self._pump(max(0.0, min(limits) - now))
        sink.flush()
        if stdin.step(run.pending, lambda: sink.flush(final=True)):
            run.answered_prompt(time.monotonic())  # the user answered a prompt: progress
        if stdin.front is not None and stdin.front.socket is not None:
            self.channels.watch(stdin.front.socket, stdin.open is not None)
        now = time.monotonic()
        run.end_drained(now)
        if now >= next_liveness:
            self._check_deaths(run, now)
            next_liveness = now + LIVENESS_PERIOD_S
            for tick in list(self._ticks):  # %clorch top, on this thread (it never waits)
                tick()
        if watch.due(now):
            watch.check()
        while (command := run.next_command(now)) is not None:
            self._do(run, watch, command)
        return next_liveness

    def _do(self, run: CellRun, watch: HangWatch, command: Interrupt | GiveUp | FreeGroup) -> None:
        """Carry out a command of the cell's state machine."""
        if isinstance(command, GiveUp):
            self._give_up(run, command)
            return
        if isinstance(command, FreeGroup):
            freed = self.free_group(command.ranks)
            run.group_checked(freed.aborted, time.monotonic(), freed.elsewhere)
            return
        watch.stop()  # being interrupted: the report will say why instead
        if command.diagnose:
            # Before the interrupt moves anything: where each rank was while it was stuck. Briefly:
            # the interrupt waits for it.
            run.diagnosed(self._diagnosis_text(timeout_s=INTERRUPT_PROBE_S, raised=run.raised()))
        if command.ranks:
            self._pump(0)  # prompts that came while a blocking answer() held the loop: dropped below
            self._launcher.interrupt(list(command.ranks))
            if self._waited.stdin is not None:  # an interrupted rank's queued prompt is not asked
                self._waited.stdin.drop(command.ranks)
        run.interrupted(command.ranks, time.monotonic())

    def _on_keyboard_interrupt(self, run: CellRun, watch: HangWatch) -> None:
        """Kernel > Interrupt while waiting: interrupt the ranks and keep waiting for the grace
        period. A second one stops waiting at once, also when it lands while the first is still
        asking the ranks where they are (up to INTERRUPT_PROBE_S): from then on nothing more is
        asked (no probe, no stacks), so the cell ends now and its wait is finished properly."""
        again = run.user_interrupt()
        try:
            self._do(run, watch, run.interrupt_command())
            if again:
                self._give_up(run, run.give_up_command())
        except KeyboardInterrupt:
            run.hurry_up()
            self._do(run, watch, run.interrupt_command())
            self._give_up(run, run.give_up_command())

    def _give_up(self, run: CellRun, command: GiveUp) -> None:
        """Stop waiting for ranks that did not return; find where each one is (see CellRun.gave_up)."""
        diagnosis = (self._diagnosis_text(timeout_s=INTERRUPT_PROBE_S, raised=run.raised())
                     if command.diagnose else None)
        alive = [r for r in command.ranks if self._launcher.ranks[r].alive]
        answers = {} if command.hurry or not alive else self._prober.ask(alive, light=True,
                                                                         timeout_s=INTERRUPT_PROBE_S)
        stacks = {} if command.hurry else {r: self.stack_of(r) for r in command.ranks}
        run.gave_up(diagnosis, answers, stacks)

    def _check_deaths(self, run: CellRun, now: float) -> None:
        for rank in self._launcher.dead(run.pending):
            proc = self._launcher.ranks[rank]
            self._pump(0)  # keep what it said before it died
            tail = self.cell_names.name(self._launcher.death_report(rank), rank)
            if run.died(rank, proc.exit, proc.host, tail, now):
                run.death_diagnosed(self._diagnosis_text(raised=run.raised()))

    # ----------------------------------------------------------------------------- reading
    def _pump(self, timeout_s: float) -> None:
        """Receive what arrives within ``timeout_s`` on any rank's channels and route it (one
        pass, see Channels.read) to the running cell, or the ledger between cells."""
        for rank, kind, msg in self.channels.read(timeout_s):
            now = time.monotonic()
            cell = self._waited.run
            if kind == "shell":
                self.ledger.reply(rank, msg, cell, now)
            elif kind == "stdin":
                self._apply(self.ledger.input_request(rank, msg, cell, now))
            else:
                self._apply(self.ledger.iopub(rank, msg, cell, now))

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Show):
                self._waited.sink.output(effect.item)
            elif isinstance(effect, CommMessage):
                if self._comm_sink is None:
                    continue
                deliver = functools.partial(self._comm_sink, effect.rank, effect.msg)
                if effect.in_cell:
                    self._waited.sink.comm(effect.rank, deliver)
                else:
                    deliver()
            elif isinstance(effect, DebugEvent):
                if self._debug_sink is not None:
                    self._debug_sink(effect.rank, effect.msg)
            elif isinstance(effect, InputRequest):
                assert self._waited.stdin is not None
                self._waited.stdin.request(effect.rank, effect.msg)
            elif isinstance(effect, EndOfFile):
                self.channels.answer(effect.rank, "\x04")

    def settle(self, rank: int, msg_id: str, timeout_s: float) -> bool:
        """Between cells: route what the ranks send until ``rank``'s idle status for ``msg_id`` (a
        request that is no cell, e.g. a front end's comm message), at most ``timeout_s``; False if
        it did not come (the rest is routed at the next read)."""
        settling = self.ledger.settling
        settling[rank] = msg_id
        deadline = time.monotonic() + timeout_s
        try:
            while settling.get(rank) == msg_id:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pump(left)
            return True
        finally:
            if settling.get(rank) == msg_id:
                del settling[rank]

    def pump_between_cells(self, late_limit: int) -> None:
        """Between cells: route what has arrived, without waiting, so that widget traffic of a
        rank's thread reaches the front end live (clorch_repl.notebook.comms calls this from the
        notebook kernel's event loop). Output meanwhile waits for the next cell as before; while
        ``late_limit`` pieces of it wait, nothing is read and ZeroMQ's queues hold the rest."""
        if len(self.ledger.late) < late_limit and self._waited.run is None:
            self._pump(0)
