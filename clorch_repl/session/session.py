"""A session: one group of ranks, as the notebook, a script or an agent drives it (the engine).

No IPython: the driver shows and answers through hooks (:mod:`.hooks`). It composes a launcher and
the cells' I/O (:mod:`.relay`) with the rules that span both: no cell on a dead or still-busy rank,
no process left by a failed start, the settings and logs kept by restart."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from ..diagnosis import DEFAULT_HANG_NOTICE_S
from ..errors import ClorchError, ConfigError, StartInterrupted, StartupError, ranks_are
from ..common import workdir
from ..common.rank_sets import rank_words
from ..launchers.base import Launcher, Progress
from ..launchers.local import LocalLauncher
from ..launchers.spares import lost_spares
from ..common.topology import Topology
from ..wire import PROTOCOL_VERSION
from ..wire.requests import request_code
from . import recovery, saves
from .cell_labels import RankCells
from .hooks import Debugger, NoStdin, SessionHooks, StdinHook, WidgetHook, stdin_of
from .lifecycle import Lifecycle, SessionState
from .protocol import CellOutcome, CellRequest, Status
from .rank_report import RankReport, rank_reports
from .relay import INTERRUPT_GRACE_S, Relay, StartedCell
from .sink import OutputSink
from .inspecting import Inspecting
from .suspend import Suspending
from .cell_rules import cell_ranks, cell_request
from .view import SessionView, not_running_view, session_view

logger = logging.getLogger(__name__)

LauncherFactory = Callable[[Topology], Launcher]
#: Time allowed, beyond the process-group timeout, for ranks to import torch and join.
JOIN_MARGIN_S = 120.0


class Session(Inspecting, Suspending):
    """Start, run cells on, inspect, restart and stop one group of worker kernels.

    Where the ranks run is the launcher's business (:mod:`clorch_repl.launchers`): ``launcher``
    makes one for a topology (default: :class:`~clorch_repl.launchers.LocalLauncher`). The
    launcher lives from the first start to the final stop: a restart asks it for fresh kernels in
    the same place (the same directory of logs, the same allocation of a cluster)."""

    def __init__(self, topology: Topology, launcher: LauncherFactory = LocalLauncher,
                 hooks: SessionHooks | None = None) -> None:
        #: what the driving process offers between cells (widgets, the debugger panel): see .hooks
        self.hooks = hooks if hooks is not None else SessionHooks()
        self.topology = topology
        self._make_launcher = launcher
        self.group: Launcher | None = None
        self.relay: Relay | None = None
        #: where the ranks' widget messages go (the hooks' answer for this group), if anywhere
        self.comms: WidgetHook | None = None
        #: JupyterLab's debugger forwarded to a rank (%clorch debugger), if on
        self.debugger: Debugger | None = None
        self.started_at: float | None = None
        #: the session's --hang-notice (seconds; 0 = off), used by cells that give none
        self.hang_notice_s: float = DEFAULT_HANG_NOTICE_S
        #: the user's cell running now: (its first line, its ranks, time.monotonic() at its start);
        #: read by %clorch top's thread (clorch_repl.notebook.panel)
        self.current_cell: tuple[str, tuple[int, ...], float] | None = None
        #: what the session is (clorch_repl.session.lifecycle): changed here alone, read by all
        self.life = Lifecycle()
        #: how often the group was formed again in place (kernel.regroup meets under this number)
        self._generation = 0
        #: ranks that cannot be in a group (dead or stuck) while the session is degraded
        self._lost: tuple[int, ...] = ()
        self.cells = RankCells()  # the last cell sent to each rank, and when (%clorch top's cell column)
        self._numbered = 0  # the highest cell number sent to the ranks (see begin: who numbers cells)

    # ------------------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self.relay is not None and self.life.running

    def start(self, progress: Progress = lambda _: None) -> float:
        """Start every rank and form the process group; returns the seconds the user waited (from ``progress.since``).

        On any failure, or a KeyboardInterrupt, every rank already started is stopped again. A
        warm spare can die between the launcher's last look at it and the group's forming (the
        out-of-memory killer, a user's kill): the start then ends those ranks and starts them
        cold, once, rather than fail a restart that a cold start would have made."""
        t0 = getattr(progress, "since", None) or time.monotonic()
        if self.group is None:
            self.group = self._make_launcher(self.topology)
        try:
            try:
                self._form_group(progress)
            except ClorchError as exc:
                interrupted = isinstance(exc, StartupError) and exc.outcome is not None and exc.outcome.interrupted
                lost = "" if interrupted else lost_spares(self.group)  # the user's Ctrl-C is no cue to retry
                if not lost:
                    raise
                logger.warning("clorch_repl: %s while joining (%s); starting the ranks cold", lost, exc)
                progress(f"{lost} while joining; starting the ranks cold")
                self.stop(keep_logs=True, polite=False)
                self._form_group(progress)
            try:
                self.group.group_formed()  # warm spares for the next restart; the group works without them
            except (ClorchError, OSError, RuntimeError) as exc:
                logger.warning("clorch_repl: could not prepare for the next restart (%s); restarts start cold", exc)
            self.started_at = time.time()
            self._generation = 0
            self.life.move("formed")
            elapsed = time.monotonic() - t0
            n = self.topology.nproc
            progress(f"{n} rank(s) ready, {self.topology.backend} process group formed in {elapsed:.1f} s")
        except KeyboardInterrupt as exc:  # until start returns: the ranks are nobody's otherwise
            # not politely: a start's ranks hold nothing to flush, and the relay may not be connected
            raise StartInterrupted(self.stop(polite=False)) from exc
        except BaseException:
            self.stop()
            raise
        return elapsed

    def _form_group(self, progress: Progress) -> None:
        """Launch the ranks, open their channels and have them join the process group."""
        assert self.group is not None
        self.life.move("start")  # from stopped: a first start, a restart, or a cold retry after spares failed
        self.group.launch(progress)
        self.topology = self.group.topology  # a remote launcher learns devices and backend
        n = self.topology.nproc
        self.relay = Relay(self.group)
        self._bridge_widgets(self.relay)
        self.relay.connect(lambda k, total: progress(f"ranks ready {k}/{total}"))
        progress(f"ranks ready {n}/{n}; joining the {self.topology.backend} process group")
        # Bounded: the process group's own timeout, plus time to import torch.
        join = CellRequest(request_code("join", env=self.group.join_environment(), protocol=PROTOCOL_VERSION),
                           tuple(range(n)), timeout_s=self.topology.timeout_s + JOIN_MARGIN_S)
        outcome = self.relay.execute(join, silent=True)
        if outcome.ended_by_user:
            # the user's Ctrl-C ended the join: ranks interrupted, returned, stuck, or even dead of it
            # (torch's import cut short can segfault): its doing, not theirs
            raise StartInterrupted([])  # (start() stops the ranks and says what outlived that)
        if not outcome.ok:
            raise StartupError("the ranks could not form their process group", outcome)

    def _bridge_widgets(self, relay: Relay) -> None:
        """The ranks' widget messages to where the hooks say (the notebook's front end), if anywhere."""
        self.comms = self.hooks.widgets(relay)
        relay.set_comm_sink(self.comms.from_rank if self.comms is not None else None)

    def stop(self, *, keep_logs: bool = False, polite: bool = True, say: Callable[[str], None] = saves.logged) -> list[str]:
        """End every rank (no process left behind); returns what survived, which should be nothing.
        ``keep_logs`` keeps the launcher (its logs, hosts, warm spares) for a restart; ``polite=False``
        ends the ranks at once (their state is being thrown away). A polite end of idle ranks first
        waits for an asynchronous checkpoint save still writing, telling ``say`` (:mod:`.saves`)."""
        group, relay = self.group, self.relay
        polite = polite and self.life.state is not SessionState.SUSPENDED  # a leave would wait on locked CUDA
        if polite:
            saves.before_polite_end(self, say)
        self.life.move_if("stop")
        self.relay = None
        if not keep_logs:
            self.group = None
        self.debug_rank(None)
        if relay is not None:
            relay.set_comm_sink(None)  # no widget opened during the leave below may reach a closed bridge
        if self.comms is not None:  # the ranks' widgets leave the notebook kernel's comm manager
            self.comms.close()
            self.comms = None
        if group is None:
            self.life.move_if("stopped")
            return []
        if relay is not None:
            # No request to leave the group first: a local rank asked to shut down ends its process
            # without the interpreter's teardown (kernel.quick_exit), and a called-back or adopted
            # rank is ended by SIGTERM (its launcher's stop), so no ProcessGroupNCCL destructor runs
            # to warn either way, and the driver frees what NCCL held at the exit;
            # destroy_process_group's finalize of every communicator was the largest part of a
            # healthy GPU restart's stop.
            relay.close()
        try:
            left = group.stop(polite=polite)
        finally:
            self.life.move_if("stopped")
            if not keep_logs:
                self.kept_logs = ""  # (what logs() reads from now on: never an earlier stop's)
                group.close()  # even after a second Ctrl-C during the stop
                self.kept_logs = getattr(group, "kept_logs", "")
        return left

    def restart(self, progress: Progress = lambda _: None, ranks: list[int] | None = None,
                sink: OutputSink | None = None) -> float:
        """Fresh ranks and a fresh process group with the same settings; logs are kept (appended).

        A healthy group (every rank alive and idle) is stopped politely, as ``%clorch stop`` does: its ranks
        shut down, so their threads, atexit handlers and file buffers run (not the interpreter's teardown:
        kernel.quick_exit), and their process group ends with their processes. A group with a dead, hung or busy rank is ended at once, as
        torchrun's agent ends its workers when one fails: SIGTERM, which a rank that must flush something can
        handle (the supervisor's grace, 5 s), then SIGKILL; a broken group asked to shut down would only wait.
        The new ranks start once every process of the old ones has exited (issue 39: on GPUs the driver frees a
        process's memory at its exit; the old kernel's last words come before the new one's log banner). An
        interrupt (Ctrl-C) during the restart stops everything, warm spares included. ``ranks``: only those ranks
        start afresh (dead, stuck or not); the others keep their processes and namespaces and form the group again
        with them (:func:`recovery.replace`); what their ranks print meanwhile goes to ``sink``. Refused: a session
        never started, as ``%clorch restart`` refuses it (a quiet start hid a script's missing ``start()``; one that
        ran once restarts whatever became of it: a failed restart's retry, after ``stop()``, where the magics
        forget the session), and a deleted working directory, before any rank is ended (:mod:`..common.workdir`)."""
        if self.group is None and self.started_at is None:
            raise ConfigError(f"nothing to restart: {self.hooks.verbs.to_start} first")
        workdir.working_directory()  # the new ranks start in it: refused before any rank is ended, where it is gone
        if ranks is not None:
            return self._replace(ranks, progress, sink)
        group, relay = self.group, self.relay
        healthy = (group is not None and relay is not None and all(p.alive for p in group.ranks)
                   and not relay.busy())
        try:
            self.stop(keep_logs=True, polite=healthy, say=progress)
            return self.start(progress)
        except KeyboardInterrupt as exc:  # (start() has stopped what it started: what outlived that)
            left = exc.left if isinstance(exc, StartInterrupted) else self.stop(polite=False)
            raise StartInterrupted(left, "restart") from exc
        except BaseException:
            self.stop()
            raise

    def _replace(self, ranks: list[int], progress: Progress, sink: OutputSink | None) -> float:
        group, relay = self._require()
        verbs = self.hooks.verbs
        ranks = list(cell_ranks(ranks, self.topology.nproc, verbs.ranks))
        dead = [r for r in recovery.died_between_cells(group) if r not in ranks]  # nothing to keep: theirs too
        ranks = sorted({*ranks, *dead})  # (the advice after a rank stuck while another was dead named one)
        if why := group.cannot_replace(ranks):
            raise ConfigError(why)
        if len(ranks) == self.topology.nproc:
            raise ConfigError(f"{verbs.ranks}{' and the dead ranks' if dead else ''} name every rank: {verbs.restart} "
                              f"(without {verbs.ranks}) starts them all afresh")
        # others still in a cell: freed if they wait in a collective (for the ranks replaced, most likely)
        busy = recovery.free_waiting(relay, group, [r for r in relay.busy() if r not in ranks and group.ranks[r].alive])
        if busy:
            raise ClorchError(f"{ranks_are(busy)} still running a cell, so the group cannot form again with it: "
                              f"wait, {verbs.interrupt}, or restart {'it' if len(busy) == 1 else 'them'} too")
        if dead:  # said once nothing refuses the restart
            progress(f"{ranks_are(dead)} dead too, so {'it starts' if len(dead) == 1 else 'they start'} afresh as well")
        t0 = time.monotonic()
        self.life.move("replace" if self.life.can("replace") else "abort", f"replacing {rank_words(ranks)}")
        self._generation += 1
        try:
            done = recovery.replace(relay, group, ranks, self._generation, progress, sink, verbs)
        except BaseException:
            self._settle(False, f"replacing {rank_words(ranks)} failed", ranks)
            raise
        self._settle(done.ok, done.why, ranks)
        if not done.ok:
            raise ClorchError(done.line.removeprefix("clorch: "))
        progress(done.line.removeprefix("clorch: "))
        try:
            group.group_formed()  # warm spares for the next replacement or restart
        except (ClorchError, OSError, RuntimeError) as exc:
            logger.warning("clorch_repl: could not prepare for the next restart (%s); restarts start cold", exc)
        return time.monotonic() - t0

    def _recover(self, why: str, aborted_at: float, said_dead: Iterable[int] = ()) -> str:
        """Ranks were freed by aborting the group (a cell's FreeGroup, or %clorch interrupt): form it again
        in the same processes, or say who is lost (:mod:`.recovery`); the line (``said_dead``: as there)."""
        group, relay = self._require()
        self.life.move("abort", why)
        self._generation += 1
        done = recovery.after_abort(relay, group, self._generation, aborted_at, said_dead, self.hooks.verbs)
        self._settle(done.ok, done.why, done.lost)
        return done.line

    def _settle(self, formed: bool, why: str, lost: Iterable[int]) -> None:
        """The end of a recovery: the group formed (nothing lost), or ``lost`` ranks cannot be in one."""
        self.life.move("formed" if formed else "degrade", why)
        self._lost = () if formed else tuple(sorted(set(self._lost) | set(lost)))

    @property
    def lost(self) -> tuple[int, ...]:  # ranks that cannot be in a group (dead or stuck) while degraded
        return self._lost

    # ------------------------------------------------------------------------------- cells
    def run(self, code: str, ranks: list[int] | None, timeout_s: float | None,
            sink: OutputSink | None, *, silent: bool = False, hang_notice_s: float | None = None,
            stdin_ranks: list[int] | None = None, cell_number: int | None = None,
            stdin: StdinHook | NoStdin | None = None) -> CellOutcome:
        """Run ``code`` on ``ranks`` (None: all), output to ``sink`` and prompts to ``stdin`` (None:
        ``sink`` if it answers prompts, see :mod:`.hooks`); ``silent``: clorch's own request (not
        in the ranks' history). ``stdin_ranks``: whose prompts reach the hook (default all);
        ``cell_number``: the cell's number on the ranks (the notebook's ``[n]``; None: see :meth:`begin`)."""
        if silent:
            _, relay = self._require()
            return relay.execute(self._request(code, ranks, timeout_s, silent=True), sink, silent=True)
        if self.life.state is SessionState.READY and (dead := recovery.died_between_cells(self._require()[0])):
            line = self._recover(f"{rank_words(dead)} died", time.monotonic(), dead)  # as after a death in a cell
            raise recovery.died_between_cells_error(self.group, dead, line)
        started = self.begin(code, ranks, timeout_s, hang_notice_s=hang_notice_s, stdin_ranks=stdin_ranks,
                             cell_number=cell_number, stdin=stdin_of(sink, stdin))  # a Ctrl-C during its send marks it (StartedCell.interrupted)
        return self.finish(started, sink)

    def begin(self, code: str, ranks: list[int] | None, timeout_s: float | None, *,
              hang_notice_s: float | None = None, stdin_ranks: list[int] | None = None,
              cell_number: int | None = None, stdin: StdinHook | NoStdin | None = None) -> StartedCell:
        """Send a user's cell to the chosen ranks and return at once (see :meth:`Relay.begin`);
        :meth:`finish` waits for it. Everything that can refuse the cell (a dead or busy rank, a
        bad option) refuses it here, before any rank is sent anything. ``stdin``: what answers
        the ranks' prompts (None: nobody). ``cell_number``: the cell's ``In[n]`` on every rank it
        runs on; without one, the session numbers the cell itself (one more than any number it
        sent) unless the driver numbers its cells (``SessionHooks.numbers_cells``, which says
        why and the whole rule): every rank then names it alike, whichever ranks ran before."""
        _, relay = self._require()
        if cell_number is None and not self.hooks.numbers_cells:
            cell_number = self._numbered + 1
        request = self._request(code, ranks, timeout_s, hang_notice_s=hang_notice_s, stdin_ranks=stdin_ranks,
                                cell_number=cell_number)
        if cell_number is not None:  # the rules passed: this number is spent
            self._numbered = max(self._numbered, cell_number)
        first = next((line.strip() for line in code.splitlines() if line.strip()), "")
        self.current_cell = self.cells.sent(first if cell_number is None else f"[{cell_number}] {first}", request.ranks)
        try:
            return relay.begin(request, stdin=stdin)
        except BaseException:  # not sent (the relay ended whatever it had sent; a Ctrl-C marks the handle)
            self.current_cell = None
            raise

    def finish(self, started: StartedCell, sink: OutputSink | None, *, interrupted: bool = False) -> CellOutcome:
        """Wait for a cell :meth:`begin` sent, streaming its output to ``sink`` (see
        :meth:`Relay.finish`: ``interrupted``, or a handle whose send was interrupted, ends it as
        interrupted); the hooks' ``waiting`` is held meanwhile (the notebook kernel reads busy)."""
        relay = self.relay
        try:
            if relay is None:
                raise ConfigError("the ranks were stopped before the cell sent to them finished")
            interrupted = self._say_degraded() or interrupted
            with self.hooks.waiting():
                outcome = relay.finish(started, sink, interrupted=interrupted)
                died = [r.rank for r in outcome.ranks.values() if r.status is Status.DIED]
                if not (outcome.ok or outcome.group_aborted or died) and self.life.state is SessionState.READY:
                    recovery.abort_if_out_of_step(relay, outcome)  # a collective that failed on some ranks
                if outcome.group_aborted or died:
                    why = (outcome.diagnosis or "").split("\n", 1)[0]
                    outcome.recovery = self._recover(why, outcome.aborted_at or time.monotonic(), died)
        except BaseException:
            if relay is not None:
                relay.abandon(started)  # waiting() raised before the wait: as a raising output hook leaves it
            self.current_cell = None
            try:
                self.hooks.cell_ended(started.request.cell_number)
            except Exception:  # noqa: BLE001 - the cell's own exception is the one to see
                logger.exception("clorch_repl: the session hooks' cell_ended raised as a cell failed")
            raise
        self.current_cell = None
        self.hooks.cell_ended(started.request.cell_number)
        return outcome

    def _request(self, code: str, ranks: list[int] | None, timeout_s: float | None, *, silent: bool = False,
                 hang_notice_s: float | None = None, stdin_ranks: list[int] | None = None,
                 cell_number: int | None = None) -> CellRequest:
        """The request for a cell, once every rule that refuses one is checked (see .cell_rules)."""
        group, relay = self._require()
        return cell_request(code, self.chosen(ranks), timeout_s, group=group, relay=relay, life=self.life,
                            nproc=self.topology.nproc, verbs=self.hooks.verbs, silent=silent,
                            hang_notice_s=self.hang_notice_s if hang_notice_s is None else hang_notice_s,
                            stdin_ranks=stdin_ranks, cell_number=cell_number)

    def chosen(self, ranks: list[int] | None) -> tuple[int, ...]:
        """The ranks a cell runs on: ``ranks``, or every rank of the session when None (every
        live, idle rank while the session has lost some: see .lifecycle)."""
        if ranks is not None:  # checked as %%distributed --ranks is, named as the driver's user writes it
            return cell_ranks(ranks, self.topology.nproc, self.hooks.verbs.ranks)
        if self.life.state is SessionState.DEGRADED:
            return recovery.survivors(self._require()[0], self._lost, self.life.why, self.hooks.verbs)
        return tuple(range(self.topology.nproc))

    def _say_degraded(self) -> bool:
        """The hooks' notice that the ranks lost some of their group, before a cell's output; True
        when a Ctrl-C came meanwhile. The cell is already sent: nothing here may keep :meth:`finish`
        from waiting for it (a failure is logged: warnings as errors), and a Ctrl-C ends it as interrupted."""
        try:
            if (line := recovery.degraded_notice(self)) is not None:
                self.hooks.notice(line)
        except (ClorchError, Warning) as exc:
            logger.warning("clorch_repl: the lost ranks' notice before a cell could not be given: %s", exc)
        except KeyboardInterrupt:
            return True
        return False

    def interrupt(self, grace_s: float = INTERRUPT_GRACE_S) -> tuple[dict[int, str], str | None]:
        """KeyboardInterrupt on every rank; returns the stacks of ranks still busy after ``grace_s``
        (none when they waited in a collective and the group was aborted and formed again) and
        the recovery's line, if there was one.

        The one method safe from another thread than the session's own (the one that started it):
        while a cell is waited for, that cell is interrupted as Ctrl-C would (its outcome says the
        rest); otherwise only the ranks' signals are sent (no stacks, no recovery: those use the
        session's sockets). Either way it returns ({}, None) at once (see .waited)."""
        group, relay = self._require()
        if relay.interrupt_waiting(otherwise=None if relay.owned_here() else group.interrupt) or not relay.owned_here():
            return {}, None
        group.interrupt()
        deadline = time.monotonic() + grace_s
        busy = relay.busy()
        while busy and time.monotonic() < deadline:
            time.sleep(0.05)
            busy = [r for r in relay.busy() if group.ranks[r].alive]
        line = None
        if busy and self.life.state is SessionState.READY and relay.free_group(busy).aborted:
            line = self._recover(f"an interrupt did not free {rank_words(busy)}", time.monotonic())
        return {r: relay.stack_of(r) for r in relay.busy() if group.ranks[r].alive}, line

    # ------------------------------------------------------------------------------- views
    def view(self, *, last_lines: bool = False) -> SessionView:
        """The session now, read-only (status, the panel: .view); ``last_lines``: each local rank's last log line too."""
        if self.relay is None:  # before the first start, after a stop: the session's state, and no rank
            return not_running_view(self.life, self.topology, getattr(self._make_launcher, "name", ""))
        group, relay = self._require()
        return session_view(group, relay.busy(), self.life, self.cells, self.topology, generation=self._generation,
                            started_at=self.started_at, last_lines=last_lines)

    def status(self) -> list[RankReport]:
        """One row of ``%clorch status`` per rank."""
        return rank_reports(self.view(), self._require()[0].memory())

    def saves_in_flight(self) -> dict[int, list[dict[str, Any]]]:
        """rank -> its asynchronous checkpoint saves still writing (``%clorch status``), asked over control."""
        _, relay = self._require()
        if self.life.state is SessionState.SUSPENDED:
            return {}  # nothing writes while suspended, and asking would wait for the resume
        return {rank: answer["saves"] for rank, answer in relay.light_answers().items() if answer and answer.get("saves")}

    def spares(self) -> list[tuple[int, int | None, bool]]:
        """(pid, resident bytes, ready) of this session's warm spares (the launcher's own answer)."""
        return self.group.spare_usage() if self.group is not None else []

    def value_dir(self) -> str:
        """Where values between the notebook and the ranks travel (the launcher's answer)."""
        return self._require()[0].value_dir()

    def hosts(self) -> dict[int, str]:
        """rank -> host for ranks on other hosts (empty when every rank runs on this one)."""
        return {p.rank: p.host for p in self.group.ranks if p.host} if self.group is not None else {}

    def pids(self) -> list[int]:
        """The local ranks' own Python processes (their kernels, below each rank's supervisor)."""
        ranks = self.group.ranks if self.group is not None else []
        return [pid for p in ranks if not p.host and (pid := p.pid) is not None]

    def _require(self) -> tuple[Launcher, Relay]:
        if self.group is None or self.relay is None:
            raise ConfigError(f"no ranks are running: {self.hooks.verbs.to_start} first")
        return self.group, self.relay

