"""Ranks this kernel did not start: a detached local session, adopted by ``%clorch connect``.

Why a launcher of its own rather than a LocalLauncher: a LocalLauncher's ranks are its children
through jupyter_client's ``KernelManager`` (which owns their processes, their exit status and the
interrupt), and none of that can be handed to another process. What the ranks' supervisors
(:mod:`clorch_repl.host.supervisor`) already do is enough to drive them from anywhere on the host, as the same
user: their channels from each rank's connection file (0600, in the session's 0700 directory),
interrupts by signalling each rank's process group (the supervisor leads it and blocks SIGINT, as
for jupyter_client's interrupt), stacks and logs from the rank's files (:mod:`clorch_repl.host.rankfiles`), and a
stop by SIGTERM to the supervisors, which end their rank and everything it started. No process is
started here: :meth:`AdoptedLauncher.launch` refuses, so a session adopted this way cannot be
restarted in place, whole (``%clorch restart``) or in part (``--ranks``): decided for issue 36,
and said in each refusal (:func:`no_start`). A fresh rank would have to be started the way the
LocalLauncher starts one (a supervisor and a kernel through jupyter_client's KernelManager, its
connection file in the session's directory), its supervisor told to follow the hold rather than
this kernel's life, and its pids and connection file written into the session file in the same
step as the hold, or the next kernel to connect would adopt a rank that is gone and miss the new
one; and a whole restart ends every rank first, the moment the session is most easily lost. Not
built: ``%clorch stop`` then ``%clorch start --name NAME`` and ``%clorch detach`` make a new one,
and a rank stuck in a collective is freed in place by ``%clorch interrupt`` (the group re-forms).

The exit of an adopted rank cannot be waited for (it is not our child): its supervisor writes it
down when the kernel ends by itself (:func:`clorch_repl.host.supervisor.read_exit`), and a rank is
reported as it would be in the kernel that started it ("exit code 3", "killed by signal
SIGKILL"); only where nothing was written (its supervisor was killed too) as ended, its log
(``%clorch logs N``) saying how.

A dead or stuck rank cannot be started again here either, so wherever a report would advise
``%clorch restart --ranks`` for one, it asks :meth:`AdoptedLauncher.instead_of_replacing` and
says what does work in a detached session (:data:`FRESH_RANKS`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..common import procs
from ..common.rank_sets import rank_words
from ..errors import ConfigError
from ..common.topology import Topology
from ..host import hold, logfiles, supervisor
from ..placement import teardown
from .base import LaunchOptions, Launcher, Progress, RankHandle
from ..host.rankfiles import RankFiles
from ..host.supervisor import STOP_GRACE_S

logger = logging.getLogger(__name__)

#: What gives a detached session fresh ranks, since it cannot start any (see the module
#: docstring): said by every refusal of a restart and every advice about a dead or stuck rank.
FRESH_RANKS = "%clorch stop, then %clorch start --name NAME and %clorch detach"
#: How long a rank found dead waits for its supervisor to write how it ended (it does so as soon
#: as it has reaped the kernel, a few milliseconds after the kernel's pid stopped running).
EXIT_WAIT_S = 1.0


def no_start(what: str) -> str:
    """Why ``what`` (a restart, a replacement of ranks) is refused in a detached session, and what
    to do instead: the one wording of this launcher's refusals (see the module docstring)."""
    return (f"{what} is not possible in a detached session: its ranks are started by the kernel that ran %clorch "
            "start, through processes only that kernel owns, and a rank started from here would be listed in no "
            "session file and kept by no hold, so the next kernel to connect would not find it. Instead: "
            "%clorch interrupt frees ranks stuck in a collective (the group is formed again in place); for fresh "
            f"ranks, {FRESH_RANKS}")


class AdoptedRank(RankHandle):
    """One rank of a detached session: its connection file and its two processes."""

    def __init__(self, rank: int, connection_file: str, pid: int, supervisor_pid: int, started_at: float,
                 files: RankFiles) -> None:
        self.rank = rank
        self.host = ""
        self.connection_file = connection_file
        self._pid = pid
        self.supervisor_pid = supervisor_pid
        self.started_at = started_at
        self.files = files
        self._info: dict[str, Any] | None = None
        #: how the kernel ended, once it has (see exit)
        self._exit: str | None = None

    def connection_info(self, session: bool = False) -> dict[str, Any]:
        if self._info is None:
            try:
                with open(self.connection_file) as fh:
                    self._info = json.load(fh)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"rank {self.rank}'s connection file {self.connection_file} cannot be read ({exc}): "
                                  "the session has ended or its directory was removed") from None
        return dict(self._info)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def exit(self) -> str | None:
        if self._exit is None and not procs.pid_running(self._pid):
            self._exit = self._how_it_ended()
        return self._exit

    def _how_it_ended(self) -> str:
        """How the kernel ended, as its supervisor wrote it (waited for up to :data:`EXIT_WAIT_S`
        while that supervisor still runs: it writes right after reaping the kernel); without it,
        that it ended and where its log is."""
        pid_file = self.connection_file + ".pid"  # where the LocalLauncher's supervisors write it
        deadline = time.monotonic() + EXIT_WAIT_S
        while (code := supervisor.read_exit(pid_file)) is None and time.monotonic() < deadline \
                and procs.pid_running(self.supervisor_pid):
            time.sleep(0.02)
        if code is None:
            code = supervisor.read_exit(pid_file)  # written just before its supervisor exited
        return procs.describe_exit(code) if code is not None else f"ended (see %clorch logs {self.rank})"


class AdoptedLauncher(Launcher):
    """The ranks of a detached local session (see the module docstring)."""

    name = "local"

    def __init__(self, topology: Topology, session_dir: str, ranks: list[AdoptedRank], session_file: str) -> None:
        super().__init__(topology, LaunchOptions())
        self.dir = session_dir
        self.ranks: list[AdoptedRank] = ranks  # type: ignore[assignment]
        self.files = [r.files for r in ranks]
        #: the session file to remove when the session is stopped from here
        self.session_file = session_file

    @classmethod
    def from_entries(cls, topology: Topology, session_dir: str, entries: list[tuple[int, str, int, int, float]],
                     session_file: str) -> "AdoptedLauncher":
        """From the session file's rank entries (rank, connection file, pid, supervisor pid, started at)."""
        ranks = [AdoptedRank(r, conn, pid, sup, t, RankFiles(session_dir, r)) for r, conn, pid, sup, t in entries]
        return cls(topology, session_dir, ranks, session_file)

    @classmethod
    def topology(cls, options: LaunchOptions, *, nproc: str | None, devices: str | None, backend: str | None,
                 timeout: str | None) -> Topology:
        raise ConfigError(no_start("starting ranks"))

    def launch(self, progress: Progress) -> None:
        raise ConfigError(no_start("starting ranks"))

    def cannot_replace(self, ranks: list[int]) -> str:
        return no_start("%clorch restart --ranks")

    def instead_of_restarting(self) -> str:
        return f"a detached session cannot be restarted (%clorch restart is refused there): for fresh ranks, {FRESH_RANKS}"

    def instead_of_replacing(self, ranks: list[int]) -> str:
        """The advice for dead or stuck ``ranks`` of a detached session, which cannot start them
        again (:meth:`cannot_replace` says why, at length, when asked to)."""
        return (f"a detached session cannot start {rank_words(ranks)} again (%clorch restart is refused there): "
                f"for fresh ranks, {FRESH_RANKS}")

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """SIGINT to each chosen rank's process group, as jupyter_client's interrupt does: the
        supervisor leads the group and blocks SIGINT, so its kernel and the kernel's children get it."""
        for proc in self.ranks if ranks is None else [self.ranks[r] for r in ranks]:
            if proc.alive:
                teardown.interrupt(proc.supervisor_pid)

    def dump_stack(self, rank: int) -> str:
        proc = self.ranks[rank]
        return proc.files.dump_stack(proc.pid) if proc.alive else ""

    def log_tail(self, rank: int, lines: int | None = 200) -> str:
        return self.files[rank].log_tail(lines)

    def death_report(self, rank: int, lines: int = 15) -> str:
        return self.files[rank].death_report(lines)

    def memory(self) -> dict[int, tuple[int | None, int | None]]:
        from .. import cuda

        gpu = cuda.memory_by_pid() if self.topology.uses_gpu else {}
        return {p.rank: (procs.tree_rss(p.pid), gpu.get(p.pid)) for p in self.ranks if p.alive}

    def stop(self, grace_s: float = STOP_GRACE_S, *, polite: bool = True) -> list[str]:
        """SIGTERM to every supervisor (each ends its rank and all it started, with its own
        grace, then SIGKILL); then SIGKILL to whatever of their trees is left. ``polite`` changes
        nothing here: a rank ended by SIGTERM's default action runs no destructor, as a quick exit
        runs none (kernel.quick_exit), so nothing of its process group is left to warn or wait."""
        sups = [p.supervisor_pid for p in self.ranks if procs.pid_running(p.supervisor_pid)]
        ended = teardown.end_supervised(sups, teardown.deadline(grace_s))
        return teardown.outlived(sups + [p.pid for p in self.ranks] + [t.pid for t in ended])

    def close(self) -> None:
        """Remove the session's directory and its session file, but for the rank logs, as a
        session never detached does (:mod:`clorch_repl.host.logfiles`): what the ranks printed
        while no kernel was connected is often only there. Where they are: ``kept_logs``."""
        hold.remove_session_file(self.session_file, self.dir)
        self.let_go()
        self.kept_logs = logfiles.remove_keeping_logs(self.dir)
