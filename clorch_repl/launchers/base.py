"""The one seam where "where do the ranks run" is decided: :class:`Launcher` and :class:`RankHandle`.

Everything above this seam (the relay that runs cells, the session, the magics, the diagnosis)
reaches a rank only through a :class:`RankHandle`: the rank's kernel channels (a jupyter_client
``KernelClient``), whether it is still there, and a few requests (interrupt, stack dump, log tail)
that the launcher delivers however it can. Nothing above it touches a pid, a signal or a file of a
rank. Launchers are chosen by name (``%clorch start --launcher NAME``) from the entry-point group
``clorch_repl.launchers`` (see :mod:`clorch_repl.launchers`), so another package can add one:

* ``local``: the ranks are children of the notebook kernel on this host (IPC sockets, a private
  directory, a supervisor per rank); the fast path, and the default.
* ``slurm`` and ``attach``: the ranks run ``python -m clorch_repl.rank`` under a launcher the
  cluster already runs (srun, torchrun, ...) and call back to the notebook over one encrypted,
  authenticated endpoint (:mod:`.callback`); a per-rank nanny on the rank's host serves the requests.

The contract, for implementers: :meth:`Launcher.launch` starts (or, after :meth:`Launcher.stop`,
restarts) one kernel per rank and returns when every rank has a handle whose kernel can be
reached, or raises :class:`~clorch_repl.errors.ClorchError` naming the ranks (and hosts) that did
not come, after ending whatever it started. :meth:`Launcher.stop` ends the ranks' kernels and
everything they started, and keeps what hosts them (an allocation, the nannies, the logs) so that
``launch`` can start fresh kernels in the same place; :meth:`Launcher.close` ends that too.
Methods are called from the notebook's main thread only.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable

from jupyter_client import BlockingKernelClient

from ..errors import ConfigError
from ..wire.connect import ORPHAN_TIMEOUT_S
from ..common.topology import Topology

logger = logging.getLogger(__name__)

#: ``progress(text)``: one line of news while ranks start (shown in place in the notebook).
Progress = Callable[[str], None]


#: How long a start waits for remote ranks to call back, unless the user says otherwise.
START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchOptions:
    """What ``%clorch start`` was told about where the ranks run (validated by the magic)."""

    nodes: int = 1
    #: ranks per node (None: one per GPU of the node, or 2 CPU ranks; local: the topology's nproc)
    nproc_per_node: int | None = None
    #: the one address the notebook listens on for ranks calling back (None: the address of the
    #: interface that routes to the nodes)
    listen: str | None = None
    #: the port of that endpoint (0: any free port)
    port: int = 0
    orphan_timeout_s: float = ORPHAN_TIMEOUT_S
    start_timeout_s: float = START_TIMEOUT_S
    #: slurm: partition, time limit and more srun arguments (a string, split like a shell does)
    partition: str | None = None
    time: str | None = None
    srun_args: str = ""
    #: local: warm spare sets kept for a fast restart, 0 or 1 (None: the launcher decides; see
    #: :mod:`.local`)
    spares: int | None = None
    #: the session's name, should it be detached (``%clorch detach``; clorch_repl.session.registry)
    name: str | None = None


class RankHandle(abc.ABC):
    """One rank as the notebook reaches it: its kernel's channels and its state, no process details."""

    rank: int
    #: the host the rank runs on, as it named itself ("" for this host)
    host: str
    #: time.time() when this rank's current kernel started
    started_at: float

    @abc.abstractmethod
    def connection_info(self, session: bool = False) -> dict[str, Any]:
        """The kernel's connection info (``KernelManager.get_connection_info``'s shape): transport,
        address, ports, signing key, and Curve keys where the channels are encrypted."""

    def client(self) -> BlockingKernelClient:
        """A new client for the rank's kernel channels (the caller starts the channels it needs)."""
        client = BlockingKernelClient()
        client.load_connection_info(self.connection_info())
        return client

    @property
    @abc.abstractmethod
    def exit(self) -> str | None:
        """None while the rank's kernel runs; once it has ended, how ("exit code 3", "killed by
        signal SIGKILL", "lost: no word from hostB for 5 s")."""

    @property
    def alive(self) -> bool:
        return self.exit is None

    @property
    def serving(self) -> bool:
        """Whether the kernel's event loop runs (it reads requests as they come); a launcher that
        cannot tell says True."""
        return True

    @property
    @abc.abstractmethod
    def pid(self) -> int | None:
        """The rank's Python process on its host (for ``%clorch status``), None until known."""

    @property
    def where(self) -> str:
        """"rank 3" or "rank 3 on hostB": how errors name the rank."""
        return f"rank {self.rank} on {self.host}" if self.host else f"rank {self.rank}"


class Launcher(abc.ABC):
    """Starts, watches and stops the ranks of one session (see the module docstring's contract)."""

    #: the name users type after ``--launcher`` (and the entry point's name)
    name: ClassVar[str]
    #: ``"module:Class"`` of the :class:`~clorch_repl.jobs.job_ranks.JobRanks` that runs
    #: batch jobs (``launch(launcher=name)``) where this launcher runs ranks; None: it cannot
    batch_ranks: ClassVar[str | None] = None

    def __init__(self, topology: Topology, options: LaunchOptions | None = None) -> None:
        #: what the ranks are; a remote launcher completes it (backend, devices) once they call back
        self.topology = topology
        self.options = options or LaunchOptions()
        self.ranks: list[RankHandle] = []
        #: whether :meth:`launch` made warm spares the current ranks (a start whose spare dies
        #: while joining is then retried cold; see Session.start); False for launchers that keep none
        self.from_spares = False
        #: a private directory (0700) on the notebook's host for the session's own files
        #: (transfers, connect file); removed by close(). Every launcher makes one.
        self.dir = ""
        #: where close() kept the ranks' logs on this host ("" when none were kept here)
        self.kept_logs = ""

    @classmethod
    @abc.abstractmethod
    def topology(cls, options: LaunchOptions, *, nproc: str | None, devices: str | None, backend: str | None,
                 timeout: str | None) -> Topology:
        """The ranks ``%clorch start`` asks for, from its options and its ``--nproc``, ``--devices``,
        ``--backend`` and ``--timeout`` as typed (None where not given); ConfigError for what this
        launcher refuses. A launcher whose ranks report their devices when they call back returns
        what it knows before, and completes it then."""
        raise ConfigError(f"the launcher {cls.name!r} ({cls.__module__}.{cls.__qualname__}) does not say what ranks a "
                          "start gives (Launcher.topology); it was written for another clorch_repl version")

    @abc.abstractmethod
    def launch(self, progress: Progress) -> None:
        """Start one kernel per rank (fresh ones after :meth:`stop`); fill :attr:`ranks`."""

    @abc.abstractmethod
    def interrupt(self, ranks: list[int] | None = None) -> None:
        """KeyboardInterrupt in the running cell of each chosen rank (every rank with None)."""

    @abc.abstractmethod
    def dump_stack(self, rank: int) -> str:
        """The Python stack of the rank's main thread right now, even while it is blocked in native
        code ("" when it cannot be had)."""

    @abc.abstractmethod
    def log_tail(self, rank: int, lines: int | None = 200) -> str:
        """The last ``lines`` lines of everything the rank wrote (all with None), earlier kernels of
        the rank (before a restart) included."""

    def current_log_tail(self, rank: int, lines: int) -> str:
        """The last ``lines`` lines the rank's current kernel wrote, after its start banner
        (``%clorch top``'s last line: before any output, the banner is no line of the user's);
        launchers that keep no rank files on this host give the whole log's tail."""
        files = getattr(self, "files", None)  # the local launcher's rankfiles.RankFiles, one per rank
        return files[rank].current_log_tail(lines) if files else self.log_tail(rank, lines)

    def dead(self, ranks: Iterable[int] | None = None) -> list[int]:
        """The ranks of ``ranks`` (None: every rank) whose process has ended, in rank order.

        Asked before every cell of every rank it runs on, so a launcher that can look at all its
        ranks at once overrides it (the local one: one ``poll`` of the forked ranks' pidfds);
        this one asks each rank's :attr:`RankHandle.alive`."""
        wanted = None if ranks is None else set(ranks)
        return [p.rank for p in self.ranks if (wanted is None or p.rank in wanted) and not p.alive]

    def cell_began(self, ranks: tuple[int, ...]) -> None:
        """The notebook sends ``ranks`` a cell now: where their logs lie on this host, remember
        where each one is, so that a death report starts there (launchers that keep no rank files
        here report what their host gives)."""
        files = getattr(self, "files", None)  # as in current_log_tail
        for rank in ranks if files else ():
            files[rank].cell_began()

    @abc.abstractmethod
    def death_report(self, rank: int, lines: int = 15) -> str:
        """What the rank's current kernel wrote about its end (a crash report, or its last lines)."""

    @abc.abstractmethod
    def stop(self, grace_s: float, *, polite: bool = True) -> list[str]:
        """End every rank's kernel and all it started (one ``grace_s`` for all of them); keep what
        hosts them. Returns what could not be ended (should be nothing), as text.

        ``polite=False`` says the ranks' state is being thrown away (a restart of a group with a
        dead, hung or busy rank): no kernel is asked to shut down and waited for; each is ended
        at once (SIGTERM, then SIGKILL after ``grace_s``)."""

    def memory(self) -> dict[int, tuple[int | None, int | None]]:
        """rank -> (resident bytes of its process and children, its GPU memory in bytes) for each
        live rank, None where unknown (``%clorch status``); read on each rank's own host. Empty
        (unknown) by default."""
        return {}

    def spare_usage(self) -> list[tuple[int | None, int | None, bool]]:
        """(pid, resident bytes, ready) of each live warm spare (``%clorch status``): what they cost
        and whether they are ready (imports done, channels bound). Empty for launchers that keep
        none here (a nanny's spare is its host's business)."""
        return []

    def value_dir(self) -> str:
        """The folder through which the notebook and every rank exchange values (``%clorch
        pull/push``, ``--gather``: :mod:`clorch_repl.session.transfer`): private to the user
        (0700), read and written by both sides. By default :attr:`dir`, on the notebook's host,
        which ranks on other hosts reach only where it lies on a filesystem they share; a launcher
        that knows of a better place (a shared scratch of its cluster) returns that."""
        return self.dir

    def replace(self, ranks: list[int], progress: Progress) -> None:
        """End ``ranks``' kernels (where alive) and start fresh ones in their place, the other
        ranks untouched (``%clorch restart --ranks``); each fresh one joins the group through
        :meth:`join_environment`. Asked only where :meth:`cannot_replace` found nothing against it."""
        raise ConfigError(self.cannot_replace(ranks))

    def cannot_replace(self, ranks: list[int]) -> str:
        """Why :meth:`replace` cannot replace ``ranks`` here ("" when it can), asked before anything
        changes. By default it cannot: a launcher that can overrides both."""
        return (f"the {self.name} launcher cannot replace single ranks yet: %clorch restart starts every rank "
                "afresh (the ranks keep their variables until then)")

    def instead_of_replacing(self, ranks: list[int]) -> str:
        """What to advise for dead or stuck ``ranks`` where :meth:`replace` cannot replace them,
        "" where it can (the advice is then ``%clorch restart --ranks``): a report must never
        advise the command that would be refused. By default :meth:`cannot_replace`'s refusal,
        which says what to do instead; a launcher whose refusal explains at length gives a shorter
        advice (a detached session's: :class:`~clorch_repl.launchers.adopted.AdoptedLauncher`)."""
        return self.cannot_replace(ranks)

    def instead_of_restarting(self) -> str:
        """What to advise for fresh ranks where a whole ``%clorch restart`` is refused (a detached
        session's: :class:`~clorch_repl.launchers.adopted.AdoptedLauncher`); "" where it works."""
        return ""

    def join_environment(self) -> dict[str, str]:
        """Variables every rank must set in its own environment before it joins the group (see
        :func:`clorch_repl.kernel.group.join_group`), for ranks whose process was started
        before the group's meeting point was known (warm spares); empty by default."""
        return {}

    def group_formed(self) -> None:
        """Called once the ranks of a start have formed their group: a launcher may now prepare
        the next start (warm spares), without taking time from this one."""

    def checkpoint(self, action: str, ranks: list[int], timeout_s: float) -> dict[int, dict[str, Any] | None] | None:
        """``action`` (suspend or resume, :mod:`clorch_repl.host.cuda_checkpoint`) on ``ranks``' processes
        by whoever runs on their host (``%clorch suspend/resume``): each rank's reply (its
        ``outcome``, the helper's report, or an ``error``; None where none came within
        ``timeout_s``). None by default: the ranks run on this host, whose helper the session runs."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """After :meth:`stop`: end what hosts the ranks (allocations, nannies) and remove the files."""

    def let_go(self) -> None:
        """Close what this process holds open of the ranks' files (each log's reader:
        :meth:`~clorch_repl.host.rankfiles.RankFiles.cell_began`) without ending anything or
        removing a file: a session detached or handed to another kernel keeps its ranks. ``close``
        does it too."""
        for files in getattr(self, "files", None) or ():  # (as in current_log_tail)
            files.close()

    def describe(self) -> str:
        """One line for ``%clorch status``: where the ranks run."""
        hosts = sorted({r.host for r in self.ranks if r.host})
        return f"launcher {self.name}" + (f", hosts {', '.join(hosts)}" if hosts else "")
