"""The ``local`` launcher: every rank is a child of the notebook kernel, on this host.

Each rank's kernel is started by a jupyter_client ``KernelManager`` whose kernelspec runs
:mod:`clorch_repl.host.supervisor`, which starts the kernel as its child (both forked from the session's
zygote, which imported torch and the kernel once: :mod:`.forked`, issue 39): the process
jupyter_client knows is the supervisor, whose exit status mirrors the kernel's; the kernel's own
pid comes from the supervisor's pid file (stack dumps, ``%clorch status``). The supervisor is what
ends everything a rank started, daemons included, when the rank is stopped or the notebook dies.

Every file of the group (connection files, IPC sockets, logs, stack dumps, the rendezvous store)
lives in one private directory (0700) that :meth:`LocalLauncher.close` removes, logs kept. Ranks talk over IPC
sockets in that directory: nothing listens on a network port, and only this user can connect;
every message is HMAC-signed with the kernel's key.

**Warm spares** (``%clorch start --spares 0|1``) make ``%clorch restart`` take seconds less. Once
a group has formed, the launcher starts one spare per rank: a process like a rank's (same
supervisor, same environment, the same GPUs in ``CUDA_VISIBLE_DEVICES``) whose kernel is up and
which has imported torch (``CLORCH_SPARE``, :func:`clorch_repl.kernel.app.warm_imports`), but
which has no process group and no CUDA context: it touches no GPU and has never run user code, so
nothing of the old ranks can leak into it. A restart ends the old ranks, makes the spares the
ranks (they learn the new group's rendezvous file and port from the join request,
:meth:`LocalLauncher.join_environment`, and move their output to the rank's log) and, after the
group has formed, starts the next set. What remains of a restart is ending the old ranks and
forming the group (CUDA and NCCL set-up on GPUs). A spare costs what an idle rank without CUDA
costs: an interpreter with torch and ipykernel imported (measured: docs/PERFORMANCE.md, "Restart").
By default (:func:`wanted_spares`) GPU sessions keep a set, where a cold start of a rank
(interpreter, imports, then CUDA) is most of a restart, and CPU sessions do not. A spare is below a
supervisor that watches the notebook kernel like any rank's, so no spare outlives it. Where spares
are the default, loading the extension warms a set for the first start too
(:mod:`clorch_repl.magics.warm`). Spares whose environment or working
directory is no longer what a cold rank would get now, or of which one died, are ended and the
ranks started cold, with the reason shown (:meth:`LocalLauncher._stale`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import tempfile
import time
from typing import Any, Iterable

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from ..common import procs, workdir
from ..common.atomic import remove_quietly
from ..placement import teardown
from ..kernel import KERNEL_MODULE, STACK_FILE_ENV
from ..wire.rank_env import RANK_LOG_ENV, SPARE_ENV, STORE_FILE_ENV, local_place, rank_environment
from ..common.topology import Topology, host_topology
from ..host import logcap, logfiles, supervisor
from . import forked
from .base import LaunchOptions, Launcher, Progress
from .local_rank import LocalRank, ended
from .spares import wanted_spares
from ..host.rankfiles import RankFiles

logger = logging.getLogger(__name__)

KERNEL_NAME = "clorch-rank"
FORKED_KERNEL_NAME = "clorch-rank-forked"  # the same kernel, forked from the session's zygote (.forked)
STOP_GRACE_S = supervisor.STOP_GRACE_S
#: How long ranks get to leave after a shutdown request before they are sent SIGTERM (part of
#: the one shared grace period of a stop, not added to it).
SHUTDOWN_WAIT_S = 1.5

#: How long a start waits for spares that are still starting before it starts the ranks cold.
SPARE_READY_S = 120.0
class LocalLauncher(Launcher):
    """Ranks as children of the notebook kernel (see the module docstring)."""

    name = "local"
    batch_ranks = "clorch_repl.jobs.job_ranks:LocalJobRanks"

    def __init__(self, topology: Topology, options: LaunchOptions | None = None) -> None:
        super().__init__(topology, options)
        #: warm spare sets to keep (0 or 1); first: a bad $CLORCH_SPARES refuses before any file exists
        self.spares_wanted = wanted_spares(topology, self.options.spares)
        self.dir = tempfile.mkdtemp(prefix="clorch-")
        os.chmod(self.dir, 0o700)
        self.ranks: list[LocalRank] = []  # type: ignore[assignment]
        self.files = [RankFiles(self.dir, r) for r in range(topology.nproc)]
        self.store_file = ""
        self.master_port = 0
        self._spec_manager = self._write_kernelspec()
        self.zygotes = forked.Zygotes(self.dir)  # the ranks' zygote, started at the first fork
        self.spares: list[LocalRank] = []  # type: ignore[assignment]
        #: what the current ranks learn when they join (spares made ranks); see join_environment
        self._joining: dict[str, str] = {}

    def _write_kernelspec(self) -> KernelSpecManager:
        """Two specs of one command: a fresh interpreter's, a forked rank's (the zygote runs it)."""
        # The supervisor watches this process (the notebook kernel, which starts every rank).
        spec: dict[str, Any] = {
            "argv": supervisor.command(sys.executable, STOP_GRACE_S, os.getpid(),
                                       [sys.executable, "-m", KERNEL_MODULE, "-f", "{connection_file}"],
                                       pid_file="{connection_file}.pid", session_dir=self.dir),
            "display_name": "clorch_repl rank",
            "language": "python",
            "interrupt_mode": "signal",
        }
        for name, metadata in ((KERNEL_NAME, {}), (FORKED_KERNEL_NAME, {"kernel_provisioner": {
                "provisioner_name": forked.PROVISIONER}})):
            os.makedirs(os.path.join(self.dir, "kernels", name), exist_ok=True)
            with open(os.path.join(self.dir, "kernels", name, "kernel.json"), "w") as fh:
                json.dump({**spec, "metadata": metadata}, fh)
        return KernelSpecManager(kernel_dirs=[os.path.join(self.dir, "kernels")])

    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        """The environment of one rank (:mod:`clorch_repl.wire.rank_env`), plus the stack file."""
        env = rank_environment(local_place(self.topology, rank, master_port=master_port, store_file=self.store_file))
        env[STACK_FILE_ENV] = self.files[rank].stack_path
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        return env

    def _start_kernel(self, name: str, env: dict[str, str], files: RankFiles, log_fd: int) -> LocalRank:
        """One kernel below its supervisor (forked from the zygote: .forked): connection file ``NAME.json``
        and IPC sockets ``NAME-*`` in the private directory, stdout and stderr to ``log_fd``."""
        def manager_for(fork: bool) -> KernelManager:
            return KernelManager(kernel_name=FORKED_KERNEL_NAME if fork else KERNEL_NAME, transport="ipc",
                                 kernel_spec_manager=self._spec_manager, ip=os.path.join(self.dir, name),
                                 connection_file=os.path.join(self.dir, f"{name}.json"))
        cwd = workdir.working_directory()
        try:
            manager = forked.start_kernel(self.zygotes, manager_for, env=env, stdout=log_fd, stderr=log_fd, cwd=cwd)
        except KeyboardInterrupt:
            # left open: jupyter_client's runner thread may go on with this start and still hand the
            # descriptor on, and a number closed here could meanwhile name another file
            raise
        except BaseException:
            os.close(log_fd)
            raise
        os.close(log_fd)
        rank = LocalRank(files.rank, manager, files)
        rank.env, rank.cwd = env, cwd
        return rank

    def launch(self, progress: Progress) -> None:
        """Start every rank's kernel process, or make the warm spares the ranks; returns at once
        (readiness is the relay's job)."""
        workdir.working_directory()  # refused before anything is ended or started where it was deleted
        # A fresh rendezvous for every start: a restart never reads a previous group's keys.
        self.store_file = os.path.join(self.dir, f"rendezvous-{secrets.token_hex(8)}.store")
        #: the group's MASTER_PORT (the ranks meet through the FileStore; torch's names are set too)
        self.master_port = master_port = procs.free_port()
        spares, self.spares = self.spares, []
        self._joining = {}
        self.from_spares = False
        try:
            stale = self._stale(spares) or self._wait_until_serving(spares, progress)
        except BaseException:  # Ctrl-C while waiting for them: they are nobody's now
            self._end(spares, 1.0, polite=False)
            raise
        if spares and not stale:
            for spare in spares:
                self._promote(spare)
            self.ranks = spares
            self.from_spares = True
            self._joining = {STORE_FILE_ENV: self.store_file, "MASTER_PORT": str(master_port)}
            progress(f"{len(spares)} warm spare rank(s) taken")
            return
        if spares:
            logger.info("%s; starting the ranks cold", stale)  # the user sees it as progress
            progress(f"{stale}; starting the ranks cold")
            self._end(spares, 1.0, polite=False)
        self.ranks = []
        for rank in range(self.topology.nproc):
            files = self.files[rank]
            self.ranks.append(self._start_kernel(f"rank{rank}", self.rank_env(rank, master_port), files,
                                                 files.open_log()))
        if self.zygotes.broken:  # each such start is a slow one: say why
            progress(f"{self.zygotes.broken}; the ranks started as fresh interpreters")

    def _stale(self, spares: list[LocalRank]) -> str:
        """Why the warm spares cannot be the next ranks ("" when they can): one died, the set is
        incomplete, or the notebook's environment or working directory changed since they started
        (a spare has what a cold rank would have had then; ``%env NCCL_DEBUG=INFO`` and a restart
        must reach the ranks). Names changed variables, never their values."""
        if len(spares) != self.topology.nproc:
            return f"{len(spares)} warm spare(s) for {self.topology.nproc} ranks" if spares else ""
        # the kernel itself, not only its supervisor, which leaves a moment after it
        dead = [f"rank {p.rank}'s ({p.exit or 'its kernel is gone'})" for p in spares
                if not p.alive or (p.pid is not None and not procs.pid_running(p.pid))]
        if dead:
            return f"the warm spare {', '.join(dead)} ended before it was needed"
        for spare in spares:
            now = self._spare_env(spare.rank, spare.env.get(RANK_LOG_ENV, ""))
            changed = sorted(k for k in set(now) | set(spare.env) if now.get(k) != spare.env.get(k))
            if changed:
                return f"the environment changed since the warm spares started ({', '.join(changed)})"
            if not workdir.shares_folder(spare.pid, spare.cwd):
                return f"the working directory is not the folder the warm spares started in ({spare.cwd})"
        return ""

    def _wait_until_serving(self, spares: list[LocalRank], progress: Progress) -> str:
        """Spares taken right after they were started (``%load_ext`` and ``%clorch start`` in one
        cell) are still importing: wait until their kernels serve requests (the relay would wait
        for that anyway), so that what they write meanwhile is in their log when it is copied to
        the rank's. "" when they all serve; else why they cannot be used."""
        deadline = time.monotonic() + SPARE_READY_S
        said = False
        while not all(spare.serving for spare in spares):
            stale = self._stale(spares)
            if stale:
                return stale
            if time.monotonic() > deadline:
                return f"the warm spares did not finish starting within {SPARE_READY_S:.0f} s"
            if not said:
                progress("waiting for the warm spares to finish starting")
                said = True
            time.sleep(0.02)
        return ""

    def _promote(self, spare: LocalRank) -> None:
        """Make a spare the rank it was started for: the rank log gets its banner, then what the
        spare wrote while it waited (its start-up: imports, CPU binding), and the spare moves its
        output there as it joins (kernel.group.join_group)."""
        files = self.files[spare.rank]
        os.close(files.open_log())
        files.take_spare_log(spare.log_path)
        spare.files, spare.started_at, spare.log_path = files, time.time(), ""

    def _spare_env(self, rank: int, log_path: str) -> dict[str, str]:
        env = self.rank_env(rank, 0)
        env.pop(STORE_FILE_ENV, None)  # learnt when it joins: a spare never sees an old group's
        env.pop("MASTER_PORT", None)
        env.update({SPARE_ENV: "1", RANK_LOG_ENV: log_path})
        return env

    def join_environment(self) -> dict[str, str]:
        return dict(self._joining)

    def dead(self, ranks: Iterable[int] | None = None) -> list[int]:
        """The base's answer in one look at the forked ranks' pidfds (:func:`.local_rank.ended`)."""
        return ended(self.ranks if ranks is None else [self.ranks[r] for r in ranks])

    def cannot_replace(self, ranks: list[int]) -> str:  # every rank is this host's child: any can be
        return ""

    def replace(self, ranks: list[int], progress: Progress) -> None:
        """Fresh kernels for ``ranks`` beside the others (Launcher.replace): each one's warm spare where the set
        is ready and current (the rest of it ended), else cold; they meet in this start's rendezvous file.
        Like every new rank, they work in the notebook's working directory, said where the ranks kept
        started elsewhere (a ``%cd`` since): their relative paths then differ."""
        cwd = workdir.working_directory()  # refused before anything is ended or started where it was deleted
        elsewhere = sorted({p.cwd for r, p in enumerate(self.ranks) if r not in ranks and p.cwd and p.cwd != cwd})
        if elsewhere:
            progress(f"the fresh rank(s) work in {cwd}, the notebook's working directory; the others started in "
                     f"{', '.join(elsewhere)} (relative paths differ between them: %cd there and restart these "
                     "ranks again to have them alike)")
        self._end([self.ranks[r] for r in ranks], 1.0, polite=False)
        spares, self.spares = self.spares, []
        usable = spares and not self._stale(spares) and all(s.serving for s in spares)
        self._end([s for s in spares if not usable or s.rank not in ranks], 1.0, polite=False)
        tag = secrets.token_hex(3)
        for rank in ranks:
            spare = next((s for s in spares if usable and s.rank == rank), None)
            if spare is not None:
                self._promote(spare)
                self.ranks[rank] = spare
                continue
            files = self.files[rank]
            self.ranks[rank] = self._start_kernel(f"rank{rank}-{tag}", self.rank_env(rank, self.master_port), files,
                                                  files.open_log())
        self._joining = {STORE_FILE_ENV: self.store_file, "MASTER_PORT": str(self.master_port)}
        progress(f"{len(ranks)} fresh rank(s) started" + (" from warm spares" if usable else ""))

    def adopt(self, options: LaunchOptions) -> None:
        """Take a start's options: a launcher made before it (warm spares made at load) becomes
        that start's, keeping the spares it holds."""
        self.options = options
        self.spares_wanted = wanted_spares(self.topology, options.spares)

    @classmethod
    def topology(cls, options: LaunchOptions, *, nproc: str | None, devices: str | None, backend: str | None,
                 timeout: str | None) -> Topology:
        """This host's ranks (:func:`~clorch_repl.common.topology.host_topology`: ``--nproc``
        defaults to ``$CLORCH_NPROC``, else one per GPU or 2 CPU ranks)."""
        return host_topology(nproc, devices, backend, timeout)

    def memory(self) -> dict[int, tuple[int | None, int | None]]:
        """Read here, by pid: every rank runs on this host."""
        from .. import cuda

        gpu = cuda.memory_by_pid() if self.topology.uses_gpu else {}
        return {p.rank: (procs.tree_rss(p.pid), gpu.get(p.pid) if p.pid is not None else None)
                for p in self.ranks if p.alive and p.pid is not None}

    def spare_usage(self) -> list[tuple[int | None, int | None, bool]]:
        """A spare not forked yet (no pid) is not ready: left out, a set of one read "0, ready"."""
        return [(pid, procs.tree_rss(pid) if pid is not None else None, pid is not None and p.serving)
                for p in self.spares if p.alive for pid in (p.pid,)]

    def group_formed(self) -> None:
        """Start the next set of warm spares, unless turned off."""
        self.start_spares()

    def start_spares(self) -> None:
        """Start a set of warm spares (see the module docstring) unless turned off or there: after
        a group formed, or before the first start (:mod:`clorch_repl.magics.warm`). All or none: whatever fails or is
        interrupted midway ends the spares already started."""
        if not self.spares_wanted or self.spares:
            return
        tag = secrets.token_hex(3)
        spares: list[LocalRank] = []
        try:
            for rank in range(self.topology.nproc):
                log_path = os.path.join(self.dir, f"spare{rank}-{tag}.log")
                files = self.files[rank]
                spare = self._start_kernel(f"spare{rank}-{tag}", self._spare_env(rank, files.log_path), files,
                                           files.open_spare_log(log_path))
                spare.log_path = log_path
                spares.append(spare)
        except BaseException:
            self._end(spares, 1.0, polite=False)
            raise
        self.spares = spares

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """SIGINT to each chosen rank's process group (KeyboardInterrupt in its running cell)."""
        for proc in self.ranks if ranks is None else [self.ranks[r] for r in ranks]:
            if proc.alive:
                try:
                    proc.manager.interrupt_kernel()
                except (OSError, RuntimeError) as exc:  # dying right now: reported elsewhere
                    logger.debug("interrupting rank %d failed: %s", proc.rank, exc)

    def dump_stack(self, rank: int) -> str:
        proc = self.ranks[rank]
        return proc.files.dump_stack(proc.pid or proc.supervisor_pid) if proc.alive else ""

    def log_tail(self, rank: int, lines: int | None = 200) -> str:
        return self.files[rank].log_tail(lines)

    def death_report(self, rank: int, lines: int = 15) -> str:
        return self.files[rank].death_report(lines)

    def stop(self, grace_s: float = STOP_GRACE_S, *, polite: bool = True) -> list[str]:
        """End every rank and everything it started, all at once, sharing one grace period.

        Polite: a shutdown request to every kernel, up to :data:`SHUTDOWN_WAIT_S` for them to
        leave; then (at once when not polite) SIGTERM to every supervisor still running (each
        passes it to its kernel and every descendant, daemons included, and SIGKILLs them after
        its own ``--grace``), and at ``grace_s`` SIGKILL to whatever is left of the supervisors
        and the process trees seen below them. Warm spares are kept (:meth:`close` ends them).
        Returns the pids still running at the end (as text), which should be none.
        """
        left = self._end(self.ranks, grace_s, polite)
        if self.store_file:
            remove_quietly(self.store_file)  # a restart never reads the old group's keys
        return left

    def _end(self, handles: list[LocalRank], grace_s: float, polite: bool) -> list[str]:
        """:meth:`stop`'s work, for any kernels of this launcher (the ranks, or the spares)."""
        sups = [p.supervisor_pid for p in handles if p.supervisor_pid is not None]
        kernels = [p.pid for p in handles if p.pid is not None]
        if polite:
            for proc in handles:
                if proc.alive:
                    try:
                        proc.manager.request_shutdown()
                    except (OSError, RuntimeError) as exc:  # its channel is gone: SIGTERM follows anyway
                        logger.debug("shutdown request to rank %d failed: %s", proc.rank, exc)
            procs.wait_gone(kernels, timeout_s=min(grace_s, SHUTDOWN_WAIT_S))
        # The supervisors have their own grace (the same STOP_GRACE_S) from their SIGTERM; ours
        # comes teardown's one margin after it, so they finish their SIGKILLs first.
        ended = teardown.end_supervised(sups, teardown.deadline(grace_s))
        for proc in handles:
            proc.poll()
            try:
                proc.manager.cleanup_resources()
            except OSError as exc:  # leftover sockets or files of a dead kernel
                logger.debug("cleaning up rank %d failed: %s", proc.rank, exc)
            remove_quietly(proc.pid_path)
            remove_quietly(proc.serving_path)
            if proc.log_path:  # a spare that never became a rank
                remove_quietly(proc.log_path)
                remove_quietly(logcap.older_path(proc.log_path))
        return teardown.outlived(sups + kernels + [p.pid for p in ended])

    def close(self) -> None:
        """End the warm spares (no grace needed) and remove the files, but for the logs (:mod:`clorch_repl.host.logfiles`)."""
        spares, self.spares = self.spares, []
        try:
            if spares:
                self._end(spares, 1.0, polite=False)
        finally:
            self.zygotes.close()
            self.let_go()
            self.kept_logs = logfiles.remove_keeping_logs(self.dir)
