"""Detach a local session from its kernel and connect to it again from another one.

``detach`` (``%clorch detach``): the ranks stop depending on this kernel. It ends the warm spares
(they would outlive everything, owned by nobody), writes the hold (:mod:`clorch_repl.host.hold`:
the supervisors then keep their ranks after this kernel is gone, ``keep_for`` without any owner),
then the session file (:mod:`.registry`), and finally drives its own ranks the way any other
kernel would: it lets go of its LocalLauncher (closing only its channels) and adopts the ranks
(:class:`~clorch_repl.launchers.adopted.AdoptedLauncher`) in a :class:`ConnectedSession`. One
path for the first kernel and every later one: whoever drives a detached session drives it the
same way, and its exit (atexit, Kernel > Restart, SIGKILL) never ends the ranks.

``connect`` (``%clorch connect``): refuses while the hold's owner lives, unless ``take``; makes
this kernel the owner, adopts the ranks, opens their channels and carries the group's
generation (each in-place re-form of the group meets under ``clorch-regroup/<generation>`` in
its store; starting again at 0 would meet an earlier re-form's stale keys). The kernel that was
taken from learns it at its next ``%clorch`` or ``%%distributed`` (:func:`check_owner`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterable

from .. import cuda
from ..errors import ClorchError, ConfigError
from ..common.human import size, span
from ..common.rank_sets import rank_words
from ..host import hold
from ..host.logfiles import without_ansi
from ..launchers.adopted import AdoptedLauncher, no_start
from ..launchers.base import Progress
from . import registry, saves
from .hooks import SessionHooks
from .relay import Relay
from .lifecycle import SessionState
from .session import Session

logger = logging.getLogger(__name__)

#: How long connecting waits for the ranks to answer on their channels (they may be finishing a
#: cell the previous kernel started; the requests sent meanwhile are answered once it ends, see
#: clorch_repl.kernel.lean_execute._rearm), and after how long it says they are busy.
CONNECT_TIMEOUT_S = 120.0
BUSY_S = 3.0
#: Lines of each rank's log shown on connect (what they printed while nobody was connected).
TAIL_LINES = 10


class ConnectedSession(Session):
    """A session whose ranks this kernel adopted (see the module docstring): cells, status,
    interrupts, ``why`` and stop work as in the first kernel; it cannot restart the ranks."""

    def __init__(self, record: registry.SessionRecord, session_file: str, hooks: SessionHooks | None = None) -> None:
        launcher = AdoptedLauncher.from_entries(
            record.topology, record.dir,
            [(r.rank, r.connection_file, r.pid, r.supervisor_pid, r.started_at) for r in record.ranks], session_file)
        super().__init__(record.topology, lambda _topology: launcher, hooks)
        self.record = record
        self.hang_notice_s = record.hang_notice_s  # the session's setting, whichever kernel drives it
        #: the session's idle suspend, for the magics to arm (clorch_repl.magics.suspend): 0, off
        self.suspend_after_s = record.suspend_after_s

    @property
    def name(self) -> str:
        return self.record.name

    def start(self, progress: Progress = lambda _: None) -> float:
        """Open the adopted ranks' channels (they are in their group already: no join)."""
        t0 = time.monotonic()
        self.group = self._make_launcher(self.topology)
        self.life.move("start")
        try:
            self._open(progress)
        except BaseException:
            release(self)
            raise
        self.started_at = min(r.started_at for r in self.record.ranks)
        self._generation = self.record.generation
        self.life.move("formed")
        return time.monotonic() - t0

    def _open(self, progress: Progress) -> None:
        """Open channels to every rank and wait, up to :data:`CONNECT_TIMEOUT_S`, for them to
        answer: they may be finishing a cell the previous kernel started (said after :data:`BUSY_S`)."""
        self.relay = Relay(self.group)
        self._bridge_widgets(self.relay)
        try:
            self.relay.connect(lambda k, total: progress(f"ranks answering {k}/{total}"), CONNECT_TIMEOUT_S,
                               late=(BUSY_S, lambda: progress("the ranks are busy (a cell an earlier kernel "
                                                              "started?); waiting for them to answer")))
        except ClorchError:
            dead = [p.where for p in self.group.ranks if not p.alive]
            logs = ", ".join(f.log_path for f in self.group.files)
            raise ConfigError(
                (f"{', '.join(dead)} of session {self.name!r} ended" if dead else
                 f"the ranks of session {self.name!r} did not answer within {CONNECT_TIMEOUT_S:.0f} s: they "
                 "are likely still running a cell an earlier kernel started") +
                f"; their logs: {logs}. Connect again later, or end them with %clorch connect then "
                "%clorch stop") from None

    def restart(self, progress: Progress = lambda _: None, ranks: list[int] | None = None,
                sink: Any = None) -> float:
        if ranks is None:
            raise ConfigError(no_start(self.hooks.verbs.restart))  # (the rest is the launcher's words)
        return super().restart(progress, ranks, sink)  # refused by the launcher, after Session's own checks

    @property
    def generation(self) -> int:
        return self._generation

    def _require(self) -> Any:
        """Session._require, refusing once another kernel took the session: this kernel must send
        the ranks nothing, not even a cell ipykernel's shell handler begins early
        (clorch_repl.magics.head_start), whose refusal the cell then shows in the same words."""
        if self.group is not None and not self.owned():
            current = hold.read(self.record.dir)
            raise ConfigError(_taken(self.name, current))
        return super()._require()

    # Every in-place re-form of the group (a hang's recovery, a suspend, a resume) counts one more
    # generation: the session file must say the latest, or the kernel that connects after this
    # one dies would meet a re-form's stale keys. Saved right after each, while this kernel drives.
    def _recover(self, why: str, aborted_at: float, said_dead: Iterable[int] = ()) -> str:
        try:
            return super()._recover(why, aborted_at, said_dead)
        finally:
            self._save_generation()

    def suspend(self, progress: Progress = lambda _: None) -> str:
        try:
            return super().suspend(progress)
        finally:
            self._save_generation()

    def resume(self, progress: Progress = lambda _: None) -> str:
        try:
            return super().resume(progress)
        finally:
            self._save_generation()

    def keep_suspend_after(self, after_s: float) -> None:
        """``%clorch suspend --after`` here: the session's setting from now on, so the next kernel
        to connect arms it too (written while this kernel drives the session)."""
        self.suspend_after_s = after_s
        if after_s != self.record.suspend_after_s and self.owned():
            self.record = dataclasses.replace(self.record, suspend_after_s=after_s, written_at=time.time())
            registry.write(self.record)

    def _save_generation(self) -> None:
        if self._generation != self.record.generation and self.owned():
            self.record = dataclasses.replace(self.record, generation=self._generation, written_at=time.time())
            registry.write(self.record)

    def stop(self, *, keep_logs: bool = False, polite: bool = True, say: Callable[[str], None] = saves.logged) -> list[str]:
        """Session.stop while this kernel drives the session; once another took it, only let go."""
        if self.group is not None and not self.owned():
            release(self)
            return []
        return super().stop(keep_logs=keep_logs, polite=polite, say=say)

    def owned(self) -> bool:
        """Whether the session's hold still names this kernel (see clorch_repl.host.hold)."""
        current = hold.read(self.record.dir)
        return current is not None and int(current.get("owner_pid", 0)) == os.getpid()


def held_line(session: Session) -> str | None:
    """``%clorch status``'s line on a detached session this kernel drives (None for any other):
    that its ranks outlive this kernel, which kernel holds it, and how long it is kept without one."""
    if not isinstance(session, ConnectedSession) or session.group is None:
        return None
    current = hold.read(session.record.dir)
    keep_for = float(current.get("keep_for_s", session.record.keep_for_s)) if current else session.record.keep_for_s
    return (f"clorch: session {session.name!r} is detached (its ranks outlive this kernel); this kernel (pid "
            f"{os.getpid()}) drives it; kept {span(keep_for)} once no kernel drives it (%clorch sessions lists it)")


def release(session: Session) -> None:
    """Let go of ``session``'s ranks without ending them: close this kernel's channels, comm
    proxies and descriptors of the ranks' logs, forget the launcher (never closed: its directory
    is the ranks')."""
    relay, comms, group = session.relay, session.comms, session.group
    session.relay = session.comms = None
    session.group = None
    if group is not None:
        group.let_go()  # (64 ranks' log readers stayed open in this kernel at each detach)
    if comms is not None:
        comms.close()
    if relay is not None:
        relay.set_comm_sink(None)
        relay.close()
    session.life.move_if("stop", "released to the session's next kernel")
    session.life.move_if("stopped", "released to the session's next kernel")


def detach(session: Session, name: str, keep_for_s: float, progress: Progress,
           suspend_after_s: float = 0.0) -> ConnectedSession:
    """Detach ``session`` (a running local session of this kernel) as ``name``; the session
    this kernel drives from now on (see the module docstring). ``suspend_after_s``: the idle
    suspend the magics armed for it (0: none), kept in its file for every kernel that connects."""
    from ..launchers.local import LocalLauncher

    group = session.group
    if not isinstance(group, LocalLauncher):
        launcher = getattr(group, "name", "?")
        raise ConfigError(f"%clorch detach works for --launcher local sessions only; this one is {launcher}: its "
                          "ranks' nannies end them once this kernel's callback endpoint stops answering, and they "
                          "cannot yet re-register with a new kernel's endpoint (see the README, \"Sessions that "
                          "outlive the notebook\")")
    if session.relay is not None and session.life.state is SessionState.READY and (busy := session.relay.busy()):
        raise ConfigError(f"only an idle session can be detached, and a cell is running on {rank_words(busy)}: "
                          "wait for it to end (or %clorch interrupt it), then %clorch detach")
    if session.relay is None or session.life.state is not SessionState.READY:
        raise ConfigError(f"only a ready, idle session can be detached; this one is {session.life.state.value}"
                          f"{' (' + session.life.why + ')' if session.life.why else ''}: wait, or %clorch restart")
    path = registry.path_of(name)
    if os.path.exists(path) and _stale(name):
        registry.remove(name)  # a session of that name that has ended: its file is all that is left
    if os.path.exists(path):
        raise ConfigError(f"a session called {name!r} exists already ({path}): pick another --name, or end it "
                          f"(%clorch connect {name} then %clorch stop)")
    if group.spares:  # nobody could end them once this kernel is gone
        spares, group.spares = group.spares, []
        group._end(spares, 1.0, polite=False)  # noqa: SLF001 - local.py is full; this is its own clean-up
    group.spares_wanted = 0
    entries = []
    for p in group.ranks:
        # jupyter_client removes a connection file it wrote when its KernelManager is collected:
        # the file now belongs to the session, not to this kernel's manager
        p.manager._connection_file_written = False  # noqa: SLF001
        if p.pid is None or p.supervisor_pid is None:
            raise ConfigError(f"rank {p.rank}'s process is not known yet: try again in a moment")
        entries.append(registry.RankEntry(p.rank, os.path.realpath(p.manager.connection_file), p.pid,
                                          p.supervisor_pid, p.started_at))
    record = registry.SessionRecord(name=name, launcher=group.name, dir=group.dir, topology=session.topology,
                                    ranks=tuple(entries), generation=session._generation,  # noqa: SLF001
                                    keep_for_s=keep_for_s, owner_pid=os.getpid(),
                                    hang_notice_s=session.hang_notice_s, suspend_after_s=suspend_after_s)
    hold.write(group.dir, os.getpid(), keep_for_s, path)  # first: from here on this kernel's end keeps them
    registry.write(record)
    release(session)
    connected = ConnectedSession(record, path, session.hooks)
    connected.start(progress)
    logger.info("clorch_repl: detached session %s (%s)", name, group.dir)
    return connected


def _stale(name: str) -> bool:
    """Whether the session file ``name`` is of a session that ended (none of its ranks runs)."""
    try:
        record = registry.read(name)
        return registry.elsewhere(record) is None and not registry.live(record)
    except ConfigError as exc:  # damaged, or not this user's: never removed silently
        logger.info("clorch_repl: session file %s kept: %s", name, exc)
        return False


def connect(name: str | None, take: bool, progress: Progress,
            hooks: SessionHooks | None = None) -> tuple[ConnectedSession, str]:
    """Adopt the detached session ``name`` (the only one when None), driven with ``hooks``; the
    session and what its ranks printed lately (a tail of each log, and where the rest is)."""
    if name is None:
        known = registry.names()
        if len(known) != 1:
            raise ConfigError("%clorch connect NAME: " + (f"there are {len(known)} sessions: {', '.join(known)}"
                                                          if known else "no detached session of yours is running"))
        name = known[0]
    record = registry.read(name)
    host = registry.elsewhere(record)
    if host is not None:
        raise ConfigError(f"session {name!r} runs on host {host}, not here (its file is in a home directory both "
                          f"hosts share): connect from a kernel on {host}")
    if not registry.live(record):
        registry.remove(name, record.dir)
        raise ConfigError(f"session {name!r} has ended (none of its ranks runs); its file was removed")
    current = hold.read(record.dir)
    if current is None:
        raise ConfigError(f"session {name!r} is being stopped (it has no hold): start a new one")
    owner = int(current.get("owner_pid", 0))
    if owner != os.getpid() and hold.owner_alive(current) and not take:
        raise ConfigError(f"session {name!r} is driven by the kernel with pid {owner}: %clorch connect {name} --take "
                          "takes it over (that kernel is told at its next %clorch or %%distributed)")
    path = registry.path_of(name)
    hold.write(record.dir, os.getpid(), record.keep_for_s, path)
    record = dataclasses.replace(record, owner_pid=os.getpid(), written_at=time.time())
    registry.write(record)
    session = ConnectedSession(record, path, hooks)
    session.start(progress)
    return session, tails(session)


def tails(session: ConnectedSession) -> str:
    """The last lines each rank wrote to its log (what it printed while nobody was connected), as
    text: without the colour codes of a terminal (IPython's tracebacks), as ``%clorch logs`` shows them."""
    parts = []
    for rank in range(session.topology.nproc):
        text = without_ansi(session.logs(rank, TAIL_LINES)).rstrip("\n")
        if text:
            parts.append(f"--- rank {rank}, last {TAIL_LINES} lines of {session.group.files[rank].log_path} "
                         f"(%clorch logs {rank} --tail 0: all) ---\n{text}")
    return "\n".join(parts)


def check_owner(session: Session) -> str:
    """"" while this kernel drives ``session``; else why not (another kernel took it), after
    letting go of it here. Sessions that were never detached are always this kernel's."""
    if not isinstance(session, ConnectedSession) or session.group is None or session.owned():
        return ""
    current = hold.read(session.record.dir)
    release(session)
    return _taken(session.name, current)


def _taken(name: str, current: dict[str, Any] | None) -> str:
    if current is None:
        return f"session {name!r} was stopped from another kernel"
    return (f"session {name!r} was taken over by the kernel with pid {current.get('owner_pid')}: "
            f"%clorch connect {name} --take takes it back")


def gpu_memory(record: registry.SessionRecord, by_pid: dict[int, int]) -> str:
    """``%clorch sessions``' GPU memory of a session: what ``by_pid`` (GPU bytes per process,
    :func:`clorch_repl.cuda.memory_by_pid`) says its ranks hold, summed; ``cpu`` for CPU ranks;
    ``?`` where it names none of them (no nvidia-smi): never a figure nothing measured."""
    if not record.topology.uses_gpu:
        return "cpu"
    known = [by_pid[r.pid] for r in record.ranks if r.pid in by_pid]
    if not known:
        return "?"
    part = "" if len(known) == len(record.ranks) else f" ({len(known)} of {len(record.ranks)} ranks)"
    return size(sum(known)) + part


def status_rows() -> tuple[list[str], list[list[str]]]:
    """``%clorch sessions``: one row per session file of this user; stale files are removed."""
    header = ["name", "ranks", "hosts", "launcher", "state", "GPU memory", "owner", "idle", "kept until"]
    rows = []
    now = time.time()
    records = []
    for name in registry.names():
        try:
            record = registry.read(name)
        except ConfigError as exc:
            rows.append([name, "?", "?", "?", f"unreadable: {exc}", "-", "-", "-", "-"])
            continue
        host = registry.elsewhere(record)
        if host is not None:  # a shared home: that host's pids and folders are not ours to judge
            rows.append([name, f"{record.topology.nproc} x {record.topology.backend}", host, record.launcher,
                         "not checked here", "-", f"pid {record.owner_pid} on {host}", "-", "-"])
            continue
        if not registry.live(record):
            registry.remove(name, record.dir)
            continue
        records.append(record)
    # one nvidia-smi for every session, none when no session has GPU ranks
    by_pid = cuda.memory_by_pid() if any(r.topology.uses_gpu for r in records) else {}
    for record in records:
        name = record.name
        current = hold.read(record.dir) or {}
        alive = bool(current) and hold.owner_alive(current)
        owner = f"pid {current.get('owner_pid')}" + (" (this kernel)" if current.get("owner_pid") == os.getpid()
                                                      else "" if alive else " (gone)")
        since = None if alive else hold.unowned_since(record.dir)
        idle = "-" if since is None else f"{now - since:.0f} s"
        until = "while owned" if alive else _clock(since + record.keep_for_s, now) if since else "?"
        topo = record.topology
        rows.append([name, f"{topo.nproc} x {topo.backend}", record.host, record.launcher, "running", gpu_memory(record, by_pid),
                     owner, idle, until])
    return header, rows


def _clock(when: float, now: float) -> str:
    """A time of day, with its date when it is not within the next day (``--keep-for`` may run
    up to 30 days: a bare ``14:02:11`` could be any of them)."""
    return time.strftime("%H:%M:%S" if when - now < 86400 else "%Y-%m-%d %H:%M", time.localtime(when))
