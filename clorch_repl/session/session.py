"""A session: one group of ranks as the notebook sees it.

It composes where the ranks run (a launcher, :mod:`clorch_repl.launchers`) and the cells' I/O
(:mod:`.relay`) and adds the rules that span both: a cell never runs on a dead rank or on one
still busy with an abandoned cell, a failed start leaves no process behind, and restart keeps the
settings and the logs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..diagnosis import DEFAULT_HANG_NOTICE_S
from ..errors import ClorchError, ConfigError, StartupError, ranks_are
from ..launchers.base import Launcher, Progress
from ..launchers.local import LocalLauncher
from ..topology import Topology, check_unique_in_range
from . import flood
from .comms import CommBridge, notebook_kernel
from .debugger import DebugForwarder
from .kernel_status import busy_during
from .protocol import CellOutcome, CellRequest, RankState
from .relay import INTERRUPT_GRACE_S, Relay, StartedCell
from .requests import request_code
from .sink import OutputSink

logger = logging.getLogger(__name__)

LauncherFactory = Callable[[Topology], Launcher]
#: Time allowed, beyond the process-group timeout, for ranks to import torch and join.
JOIN_MARGIN_S = 120.0


@dataclass(frozen=True)
class RankReport:
    """One row of ``%clorch status``."""

    rank: int
    state: RankState
    pid: int | None
    #: the rank's host ("" for the notebook's own)
    host: str
    device: str
    backend: str
    memory_bytes: int | None
    gpu_memory_bytes: int | None
    uptime_s: float
    exit: str | None


class Session:
    """Start, run cells on, inspect, restart and stop one group of worker kernels.

    Where the ranks run is the launcher's business (:mod:`clorch_repl.launchers`): ``launcher``
    makes one for a topology (default: :class:`~clorch_repl.launchers.LocalLauncher`). The
    launcher lives from the first start to the final stop: a restart asks it for fresh kernels in
    the same place (the same directory of logs, the same allocation of a cluster)."""

    def __init__(self, topology: Topology, launcher: LauncherFactory = LocalLauncher) -> None:
        #: the notebook cells whose relayed text IPython's history keeps (see _bound_history)
        self._relayed_cells: list[int] = []
        self.topology = topology
        self._make_launcher = launcher
        self.group: Launcher | None = None
        self.relay: Relay | None = None
        self.comms: CommBridge | None = None
        #: JupyterLab's debugger forwarded to a rank (%clorch debugger), if on
        self.debugger: DebugForwarder | None = None
        self.started_at: float | None = None
        #: the session's --hang-notice (seconds; 0 = off), used by cells that give none
        self.hang_notice_s: float = DEFAULT_HANG_NOTICE_S
        #: the user's cell running now: (its first line, its ranks, time.monotonic() at its start);
        #: read by %clorch top's thread (clorch_repl.session.panel)
        self.current_cell: tuple[str, tuple[int, ...], float] | None = None
        self._cells: dict[int, tuple[str, float]] = {}  # rank -> the last cell sent to it, and when (cell_of)

    # ------------------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self.relay is not None

    def start(self, progress: Progress = lambda _: None, since: float | None = None) -> float:
        """Start every rank and form the process group; returns the seconds it took, counted from
        ``since`` (a restart's start: what the user waited, stopping the old ranks included).

        On any failure, or a KeyboardInterrupt, every rank already started is stopped again. A
        warm spare can die between the launcher's last look at it and the group's forming (the
        out-of-memory killer, a user's kill): the start then ends those ranks and starts them
        cold, once, rather than fail a restart that a cold start would have made.
        """
        t0 = time.monotonic() if since is None else since
        if self.group is None:
            self.group = self._make_launcher(self.topology)
        try:
            try:
                self._form_group(progress)
            except ClorchError as exc:
                interrupted = isinstance(exc, StartupError) and exc.outcome is not None and exc.outcome.interrupted
                lost = "" if interrupted else self._lost_spares()  # the user's Ctrl-C is no cue to retry
                if not lost:
                    raise
                logger.warning("clorch_repl: %s while joining (%s); starting the ranks cold", lost, exc)
                progress(f"{lost} while joining; starting the ranks cold")
                self.stop(keep_logs=True, polite=False)
                self._form_group(progress)
        except BaseException:
            self.stop()
            raise
        try:
            self.group.group_formed()  # warm spares for the next restart; the group works without them
        except (ClorchError, OSError, RuntimeError) as exc:
            logger.warning("clorch_repl: could not prepare for the next restart (%s); restarts start cold", exc)
        except BaseException:  # Ctrl-C in that moment: an interrupted start, which leaves nothing
            self.stop()
            raise
        self.started_at = time.time()
        elapsed = time.monotonic() - t0
        n = self.topology.nproc
        progress(f"{n} rank(s) ready, {self.topology.backend} process group formed in {elapsed:.1f} s")
        return elapsed

    def _form_group(self, progress: Progress) -> None:
        """Launch the ranks, open their channels and have them join the process group."""
        assert self.group is not None
        self.group.launch(progress)
        self.topology = self.group.topology  # a remote launcher learns devices and backend
        n = self.topology.nproc
        self.relay = Relay(self.group)
        self.comms = CommBridge(self.relay)  # widgets made on ranks, in the notebook's front end
        self.relay.set_comm_sink(self.comms.from_rank)
        self.relay.connect(lambda k, total: progress(f"ranks ready {k}/{total}"))
        progress(f"ranks ready {n}/{n}; joining the {self.topology.backend} process group")
        # Bounded: the process group's own timeout, plus time to import torch.
        join = CellRequest(request_code("join", env=self.group.join_environment()), tuple(range(n)),
                           timeout_s=self.topology.timeout_s + JOIN_MARGIN_S)
        outcome = self.relay.execute(join, silent=True)
        if not outcome.ok:
            raise StartupError("the ranks could not form their process group", outcome)

    def _lost_spares(self) -> str:
        """"the warm spare made rank 1 ended (killed by signal SIGKILL)" when this start's ranks
        were warm spares and one of them is gone; "" otherwise (a cold start's failure stands)."""
        group = self.group
        if group is None or not group.from_spares:
            return ""
        dead = [f"rank {p.rank} ({p.exit or 'gone'})" for p in group.ranks if not p.alive]
        if not dead:
            return ""
        return f"the warm spare made {', '.join(dead)} ended"

    def stop(self, *, keep_logs: bool = False, polite: bool = True) -> list[str]:
        """End every rank (no process left behind); returns what survived, which should be nothing.
        ``keep_logs`` keeps the launcher (its logs, its hosts, its warm spares) for a restart;
        ``polite=False`` ends the ranks at once, without asking them to leave the group and shut
        down (their state is being thrown away)."""
        group, relay = self.group, self.relay
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
            return []
        if relay is not None:
            idle = [p.rank for p in group.ranks if p.alive and relay.idle(p.rank)]
            if polite and idle and len(idle) == len(group.ranks):
                try:  # a clean exit for NCCL; never waits long on a sick group
                    relay.execute(CellRequest(request_code("leave"), tuple(idle), timeout_s=5.0), silent=True,
                                  interrupt_grace_s=1.0)
                except Exception:  # noqa: BLE001 - stopping goes on whatever the leave did
                    logger.warning("clorch_repl: ranks %s did not leave the process group cleanly; "
                                   "stopping them anyway", idle, exc_info=True)
            relay.close()
        try:
            left = group.stop(polite=polite)
        finally:
            if not keep_logs:
                group.close()  # even after a second Ctrl-C during the stop
        return left

    def restart(self, progress: Progress = lambda _: None) -> float:
        """Fresh ranks and a fresh process group with the same settings; logs are kept (appended).

        A healthy group (every rank alive and idle) is stopped politely, as ``%clorch stop`` does:
        its ranks leave the group and shut down, so their atexit handlers and file buffers run.
        A group with a dead, hung or busy rank is ended at once, every rank of it, as torchrun's
        agent ends its workers when one fails: SIGTERM, which a rank that must flush something on
        the way out can handle (the supervisor's grace, 5 s, applies), then SIGKILL. Asking a
        broken group to shut down would only wait, and ranks idle beside a dead NCCL peer can
        block in their communicators' teardown.
        An interrupt (Ctrl-C) during the restart stops everything, warm spares included."""
        t0 = time.monotonic()
        group, relay = self.group, self.relay
        healthy = (group is not None and relay is not None and all(p.alive for p in group.ranks)
                   and not relay.busy())
        try:
            self.stop(keep_logs=True, polite=healthy)
        except BaseException:
            self.stop()
            raise
        return self.start(progress, since=t0)

    # ------------------------------------------------------------------------------- cells
    def run(self, code: str, ranks: list[int] | None, timeout_s: float | None,
            sink: OutputSink | None, *, silent: bool = False, hang_notice_s: float | None = None,
            stdin_ranks: list[int] | None = None, cell_number: int | None = None) -> CellOutcome:
        """Run ``code`` on the chosen ranks; ``silent`` runs it as clorch's own request (not in
        the ranks' history or cell count: value transfers). ``stdin_ranks``: the ranks whose
        prompts reach the front end (every rank by default). ``cell_number``: the number the
        notebook shows for the cell, which the ranks give their run of it."""
        if silent:
            _, relay = self._require()
            return relay.execute(self._request(code, ranks, timeout_s, silent=True), sink, silent=True)
        try:
            started = self.begin(code, ranks, timeout_s, hang_notice_s=hang_notice_s, stdin_ranks=stdin_ranks,
                                 cell_number=cell_number)
        except KeyboardInterrupt:  # while the cell was being sent: every rank has it, and it ends interrupted
            unfinished = self.relay.unfinished if self.relay is not None else None
            if unfinished is None:
                raise
            return self.finish(unfinished, sink, interrupted=True)
        return self.finish(started, sink)

    def begin(self, code: str, ranks: list[int] | None, timeout_s: float | None, *,
              hang_notice_s: float | None = None, stdin_ranks: list[int] | None = None,
              cell_number: int | None = None, allow_stdin: bool | None = None) -> StartedCell:
        """Send a user's cell to the chosen ranks and return at once (see :meth:`Relay.begin`);
        :meth:`finish` waits for it. Everything that can refuse the cell (a dead or busy rank, a
        bad option) refuses it here, before any rank is sent anything. ``allow_stdin``: what
        the front end allowed, for a cell begun before ipykernel records it."""
        _, relay = self._require()
        request = self._request(code, ranks, timeout_s, hang_notice_s=hang_notice_s, stdin_ranks=stdin_ranks,
                                cell_number=cell_number)
        first = next((line.strip() for line in code.splitlines() if line.strip()), "")
        self.current_cell = (first if cell_number is None else f"[{cell_number}] {first}", request.ranks,
                             time.monotonic())
        self._cells.update(dict.fromkeys(request.ranks, (self.current_cell[0], self.current_cell[2])))
        try:
            return relay.begin(request, allow_stdin=allow_stdin)
        except BaseException:
            if relay.unfinished is None:  # not sent (a Ctrl-C leaves it sent, for finish)
                self.current_cell = None
            raise

    def finish(self, started: StartedCell, sink: OutputSink | None, *, interrupted: bool = False) -> CellOutcome:
        """Wait for a cell :meth:`begin` sent, streaming its output to ``sink`` (see
        :meth:`Relay.finish`); the notebook kernel reads busy meanwhile."""
        try:
            relay = self.relay
            if relay is None:
                raise ConfigError("the ranks were stopped before the cell sent to them finished")
            with busy_during(notebook_kernel()):
                return relay.finish(started, sink, interrupted=interrupted)
        finally:
            self.current_cell = None
            self._bound_history(started.request.cell_number)

    def _request(self, code: str, ranks: list[int] | None, timeout_s: float | None, *, silent: bool = False,
                 hang_notice_s: float | None = None, stdin_ranks: list[int] | None = None,
                 cell_number: int | None = None) -> CellRequest:
        """The request for a cell, once every rule that refuses one is checked."""
        group, relay = self._require()
        chosen = self.chosen(ranks)
        check_unique_in_range(chosen, self.topology.nproc, "--ranks", "rank")
        dead = [p for p in group.ranks if p.rank in chosen and not p.alive]
        if dead:
            what = ", ".join(f"{p.where} ({p.exit})" for p in dead)
            raise ClorchError(f"{what} is dead: run %clorch restart for a fresh group")
        busy = [r for r in relay.busy() if r in chosen]
        if busy:
            raise ClorchError(f"{ranks_are(busy)} still running an earlier cell: wait, run %clorch interrupt, "
                              "or %clorch restart")
        if stdin_ranks is not None:
            check_unique_in_range(stdin_ranks, self.topology.nproc, "--stdin-ranks", "rank")
        notice = 0.0 if silent else self.hang_notice_s if hang_notice_s is None else hang_notice_s
        try:
            limits = flood.limits_from_env(os.environ)
        except ValueError as exc:
            raise ClorchError(f"{exc} (the output limits of %%distributed cells, read from the notebook's "
                              "environment: fix it with %env, or unset it for the default)") from None
        return CellRequest(code, chosen, timeout_s, hang_notice_s=notice,
                           stdin_ranks=None if stdin_ranks is None else tuple(stdin_ranks),
                           cell_number=cell_number, output_limits=limits)

    def _bound_history(self, cell_number: int | None) -> None:
        """Keep IPython's record of this cell's relayed text bounded (see flood.bound_history).

        The record is keyed by the cell's own number (``[12]``, what IPython's output capture
        read when the cell began), not by ``shell.execution_count``, which IPython has already
        moved on to the next cell's number while this one runs: keyed by that, the bound cut an
        empty record and the notebook kept every cell's output (34 MB over 120 cells of 3,000
        lines a rank)."""
        shell = _ipython()
        history = getattr(shell, "history_manager", None)
        outputs = getattr(history, "outputs", None)
        if outputs is None:
            return
        if cell_number is None:
            result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
            cell_number = getattr(result, "execution_count", None)
        if cell_number is None:
            cell_number = shell.execution_count - 1
        flood.bound_history(outputs, int(cell_number), relayed=self._relayed_cells,
                            exceptions=getattr(history, "exceptions", None))

    def chosen(self, ranks: list[int] | None) -> tuple[int, ...]:
        """The ranks a cell runs on: ``ranks``, or every rank of the session when None."""
        return tuple(range(self.topology.nproc)) if ranks is None else tuple(ranks)

    def debug_rank(self, rank: int | None) -> None:
        """Forward the notebook kernel's debug_request (JupyterLab's debugger) to ``rank``, or,
        with None, let the notebook kernel answer them itself again (see .debugger)."""
        if rank is not None:  # checked before anything changes
            group, relay = self._require()
            check_unique_in_range([rank], self.topology.nproc, "%clorch debugger", "rank")
        if self.debugger is not None:
            self.debugger.uninstall()
            self.debugger = None
            if self.relay is not None:
                self.relay.set_debug_sink(None)
        if rank is None:
            return
        from IPython.core.getipython import get_ipython

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None or not isinstance(getattr(kernel, "control_handlers", None), dict):
            raise ClorchError("%clorch debugger needs the notebook to run in a Jupyter kernel (ipykernel), "
                              "whose front end speaks the debug protocol (JupyterLab)")
        self.debugger = DebugForwarder(kernel, shell, group.ranks[rank], rank)
        self.debugger.install()
        relay.set_debug_sink(self.debugger.event)

    def why(self, ranks: list[int] | None = None, *, all_threads: bool = False) -> str:
        """Where every rank is and the first collective they disagree on (``%clorch why``):
        the verdict, then ``ranks``' evidence (every rank's by default)."""
        from ..diagnosis import render

        _, relay = self._require()
        if ranks is not None:
            check_unique_in_range(ranks, self.topology.nproc, "--rank", "rank")
        verdict, states = relay.diagnose(all_threads=all_threads)  # every rank: the cause may be any
        shown = [s for s in states if ranks is None or s.rank in ranks]
        return render.report(verdict, shown, all_threads=all_threads)

    def interrupt(self, grace_s: float = INTERRUPT_GRACE_S) -> dict[int, str]:
        """KeyboardInterrupt on every rank; returns the stacks of ranks still busy after ``grace_s``."""
        group, relay = self._require()
        group.interrupt()
        deadline = time.monotonic() + grace_s
        busy = relay.busy()
        while busy and time.monotonic() < deadline:
            time.sleep(0.05)
            busy = [r for r in relay.busy() if group.ranks[r].alive]
        return {r: relay.stack_of(r) for r in busy if group.ranks[r].alive}

    # ------------------------------------------------------------------------------- views
    def cell_of(self, rank: int) -> tuple[str, float] | None:
        """The cell ``rank`` is busy with (``[5] first line``) and since when, also after the
        cell's wait ended with the rank stuck in it; None when the rank is not busy."""
        relay = self.relay
        return self._cells.get(rank) if relay is not None and rank in relay.busy() else None

    def status(self) -> list[RankReport]:
        group, relay = self._require()
        busy = set(relay.busy())
        usage = group.memory()
        now = time.time()
        rows = []
        for proc in group.ranks:
            pid = proc.pid  # the rank's Python process on its host
            alive = proc.alive
            rss, gpu = usage.get(proc.rank, (None, None)) if alive else (None, None)
            if not alive:
                state = RankState.DEAD
            elif self.started_at is None:
                state = RankState.STARTING
            else:
                state = RankState.BUSY if proc.rank in busy else RankState.IDLE
            rows.append(RankReport(
                rank=proc.rank, state=state, pid=pid, host=proc.host,
                device=self.topology.device_label(proc.rank),
                backend=self.topology.backend, memory_bytes=rss, gpu_memory_bytes=gpu,
                uptime_s=now - proc.started_at if alive else 0.0,
                exit=proc.exit))
        return rows

    def saves_in_flight(self) -> dict[int, list[dict[str, Any]]]:
        """rank -> its asynchronous checkpoint saves still writing (``%clorch status``), asked of the
        ranks over their control channels, so it answers while a save's thread writes."""
        _, relay = self._require()
        answers = relay.light_answers()
        return {rank: answer["saves"] for rank, answer in answers.items()
                if answer is not None and answer.get("saves")}

    def spares(self) -> list[tuple[int, int | None, bool]]:
        """(pid, resident bytes, ready) of this session's warm spares (the launcher's own answer)."""
        return self.group.spare_usage() if self.group is not None else []

    def logs(self, rank: int, tail: int | None) -> str:
        group, _ = self._require()
        check_unique_in_range([rank], self.topology.nproc, "logs", "rank")
        return group.log_tail(rank, tail)

    def value_dir(self) -> str:
        """Where values between the notebook and the ranks travel (the launcher's answer)."""
        if self.group is None:
            raise ConfigError("no ranks are running: run %clorch start first")
        return self.group.value_dir()

    def hosts(self) -> dict[int, str]:
        """rank -> host for ranks on other hosts (empty when every rank runs on this one)."""
        return {p.rank: p.host for p in self.group.ranks if p.host} if self.group is not None else {}

    def pids(self) -> list[int]:
        """The local ranks' own Python processes (their kernels, below each rank's supervisor)."""
        if self.group is None:
            return []
        return [pid for p in self.group.ranks if not p.host and (pid := p.pid) is not None]

    def _require(self) -> tuple[Launcher, Relay]:
        if self.group is None or self.relay is None:
            raise ConfigError("no ranks are running: run %clorch start first")
        return self.group, self.relay


def _ipython() -> Any:
    """The notebook's IPython shell, or None outside one (a script using the Python API)."""
    try:
        from IPython.core.getipython import get_ipython
    except ImportError:
        return None
    return get_ipython()
