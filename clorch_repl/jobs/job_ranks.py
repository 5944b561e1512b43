"""Where a batch job's ranks run: :class:`JobRanks`, one kind per launcher that can run jobs.

:func:`clorch_repl.jobs.batch.launch` names a launcher (``launcher="local"``,
``"slurm"``); the launcher registry (:mod:`clorch_repl.launchers.registry`, the entry-point group
that ``%clorch start --launcher`` reads too) gives its class, whose ``batch_ranks`` names the
:class:`JobRanks` that runs a job's ranks there. A launcher without one (``attach``: its ranks
are started by a tool outside clorch_repl) cannot run batch jobs, and says so.

A :class:`JobRanks` starts the ranks, tells the job when each has ended (``report(rank, code)``;
the job then reads the rank's result file), stops ranks on request, and answers what only it can
know: a rank's pid on this host, and what its launcher said. Everything it starts is below a
supervisor, so nothing outlives a stop or the death of the process that launched the job.
"""

from __future__ import annotations

import abc
import importlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

from ..errors import ClorchError, ConfigError, TopologyError
from ..host.rank_process import RankProcess
from ..common.procs import LOOPBACK, free_port
from ..placement import teardown
from ..placement.srun import SRUN_KILL_WAIT_S, SrunStep, srun_command, time_limit
from ..wire.rank_env import local_place, rank_environment, world_environment
from ..common.topology import Topology, nodes_topology, resolve_topology
from ..wire.results import read_result

logger = logging.getLogger(__name__)

#: ``report(rank, exit_code)``: a rank has ended (negative: killed by that signal).
Report = Callable[[int, int], None]
#: How often srun's tasks' result files are looked for.
SRUN_POLL_S = 0.2
#: how launch() names the options the shared topology checks refuse (errors.TopologyError)
LAUNCH_NAMES = {"nproc": "nproc_per_node", "timeout": "pg_timeout_s", "limit": "the job's own time limit is timeout_ms"}


@dataclass(frozen=True)
class JobPlan:
    """Everything a job's ranks are started with, decided (and validated) by ``launch``."""

    job_id: str
    directory: str
    #: the job's spec file (``_rank_entry`` reads what to call from it)
    spec_path: str
    topology: Topology
    #: the environment every rank starts from (this process's, with the job's own variables)
    base_env: Mapping[str, str]
    #: ``launch(env=...)``: set in every rank last, over everything else
    extra_env: Mapping[str, str]
    #: the collectives' timeout; the whole job's, or None
    pg_timeout_s: float
    timeout_s: float | None
    grace_s: float
    #: the job directory is this process's (removed when it ends) rather than the caller's
    owns_dir: bool
    nodes: int = 1
    srun_args: str = ""
    #: a script job's ranks (``launch(script=...)``) see their host's GPUs, their own at
    #: ``cuda:{LOCAL_RANK}``, as under torchrun; a ``main`` job's see their own GPU only (the
    #: seed's table: CUDA_VISIBLE_DEVICES = the assigned GPU)
    torchrun_gpus: bool = False

    @property
    def store_file(self) -> str:
        """The rendezvous: a FileStore in the job's private directory, which only this user can
        open (clorch_repl.distributed.rendezvous says what is and is not protected)."""
        return os.path.join(self.directory, "rendezvous.store")

    def rank_command(self) -> list[str]:
        return [sys.executable, "-m", "clorch_repl.jobs._rank_entry", self.spec_path]

    def log_path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank-{rank}.log")

    def result_path(self, rank: int) -> str:
        return os.path.join(self.directory, f"rank-{rank}.result.json")


class JobRanks(abc.ABC):
    """How one job's ranks run (see the module docstring). Methods may be called from any of the
    job's threads; ``report`` is called from threads of this object's own."""

    #: the launcher's name, as ``launch(launcher=...)`` takes it
    name: ClassVar[str]
    #: whether the ranks run on this host and answer the hang probe (a timed-out job then says
    #: where its ranks were before it stops them)
    probed: ClassVar[bool] = False

    def __init__(self, plan: JobPlan, report: Report) -> None:
        self.plan = plan
        self.report = report

    @classmethod
    @abc.abstractmethod
    def topology(cls, nproc_per_node: Any, devices: Any, backend: str | None, pg_timeout_s: Any, nodes: Any,
                 log_dir: str | None) -> Topology:
        """The job's ranks, from ``launch``'s arguments; ConfigError for what this kind refuses."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start every rank; raise ClorchError (after ending what was started) when that fails."""

    @abc.abstractmethod
    def stop(self, ranks: list[int], grace_s: float, wait: bool) -> None:
        """End the chosen live ranks and all they started: SIGTERM, SIGKILL after ``grace_s``."""

    def pid(self, rank: int) -> int | None:
        """The rank's process on this host (None: not known here)."""
        return None

    def notes(self) -> str:
        """What the launcher itself said that may explain a failure ("" when nothing)."""
        return ""


class LocalJobRanks(JobRanks):
    """One process per rank on this host, each below its supervisor, meeting over loopback."""

    name = "local"
    probed = True

    def __init__(self, plan: JobPlan, report: Report) -> None:
        super().__init__(plan, report)
        self.procs: list[RankProcess | None] = [None] * plan.topology.nproc
        self.port = 0

    @classmethod
    def topology(cls, nproc_per_node: Any, devices: Any, backend: str | None, pg_timeout_s: Any, nodes: Any,
                 log_dir: str | None) -> Topology:
        if nodes != 1:
            raise ConfigError(f"nodes={nodes!r} needs launcher='slurm' (a local job runs on this host)")
        try:
            return resolve_topology(nproc_per_node, devices, backend, pg_timeout_s)
        except TopologyError as exc:  # said with launch()'s own argument names, as local_session does
            raise exc.naming(**LAUNCH_NAMES) from None

    def environment(self, rank: int) -> dict[str, str]:
        plan = self.plan
        env = rank_environment(local_place(plan.topology, rank, master_port=self.port, store_file=plan.store_file,
                                           timeout_s=plan.pg_timeout_s, host_gpus=plan.torchrun_gpus), plan.base_env)
        env.update(plan.extra_env)
        return env

    def start(self) -> None:
        plan = self.plan
        self.port = free_port()
        try:
            for r in range(plan.topology.nproc):
                fd = os.open(plan.log_path(r), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
                # --session-dir only for a directory we own: nobody is left to read it when we are gone
                self.procs[r] = RankProcess.spawn(
                    plan.rank_command(), env=self.environment(r), log_fd=fd, grace_s=plan.grace_s,
                    pid_file=os.path.join(plan.directory, f"rank-{r}.pid"),
                    session_dir=plan.directory if plan.owns_dir else None)
        except OSError as exc:
            self.stop(list(range(plan.topology.nproc)), 0.5, wait=True)
            raise ClorchError(f"{plan.job_id}: could not start rank processes ({exc})") from exc
        for r, proc in enumerate(self.procs):
            threading.Thread(target=self._wait, args=(r, proc), name=f"clorch-{plan.job_id}-rank{r}",
                             daemon=True).start()

    def _wait(self, rank: int, proc: RankProcess | None) -> None:
        assert proc is not None
        self.report(rank, proc.wait())

    def stop(self, ranks: list[int], grace_s: float, wait: bool) -> None:
        """The chosen ranks' supervisors ended together (:func:`clorch_repl.placement.teardown.end_supervised`:
        one shared grace), from a thread of its own unless ``wait``."""
        sups = [p.supervisor_pid for r, p in enumerate(self.procs) if r in ranks and p is not None and p.running]
        if not sups:
            return
        thread = threading.Thread(target=teardown.end_supervised, args=(sups, teardown.deadline(grace_s)), daemon=True,
                                  name=f"clorch-{self.plan.job_id}-stop")
        thread.start()
        if wait:
            thread.join()

    def pid(self, rank: int) -> int | None:
        proc = self.procs[rank]
        return None if proc is None else proc.pid


class SlurmJobRanks(JobRanks):
    """Every rank a task of one ``srun`` step (``_rank_entry`` reads its place from Slurm's
    variables), meeting through the FileStore in the job directory, which the nodes share with
    this host (the spec, the results and each task's ``rank-N.log`` live there too). The step
    outlives this process if it dies (the ranks run under slurmstepd); Slurm ends it at the job's
    timeout, which becomes srun's ``--time``."""

    name = "slurm"

    def __init__(self, plan: JobPlan, report: Report) -> None:
        super().__init__(plan, report)
        self.srun: SrunStep | None = None
        self._stopping: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def topology(cls, nproc_per_node: Any, devices: Any, backend: str | None, pg_timeout_s: Any, nodes: Any,
                 log_dir: str | None) -> Topology:
        if devices is not None:
            raise ConfigError("devices is for launcher='local'; under slurm each rank uses its node's GPU LOCAL_RANK")
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"nodes must be a whole number >= 1; got {nodes!r}")
        if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ConfigError(f"launcher='slurm' needs nproc_per_node, a whole number >= 1; got {nproc_per_node!r}")
        topology = nodes_topology(nodes, nproc_per_node, backend or None, pg_timeout_s, timeout_name="pg_timeout_s",
                                  default_backend="gloo")
        if log_dir is None:
            raise ConfigError("launcher='slurm' needs log_dir on a filesystem the nodes share with this host (the "
                              "job's spec, rendezvous file, results and logs live there); /tmp is not shared")
        return topology

    def start(self) -> None:
        plan = self.plan
        env = world_environment(plan.topology.backend, plan.pg_timeout_s, plan.store_file, plan.base_env)
        # The ranks meet through the FileStore (CLORCH_STORE_FILE); torch's env:// names are set
        # all the same, as a local job's are (the store is chosen by MASTER_PORT's match).
        env.update({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())})
        env.update(plan.extra_env)
        name = f"clorch-{plan.job_id}"
        command = srun_command(plan.nodes, plan.topology.nproc // plan.nodes, name, srun_args=plan.srun_args,
                               output=os.path.join(plan.directory, "rank-%t.log"), time=time_limit(plan.timeout_s))
        # the tasks write their own rank-N.log (--output); srun's own word goes to srun.log
        self.srun = SrunStep.start(command + plan.rank_command(), env=env, name=name, what=plan.job_id,
                                   log_path=os.path.join(plan.directory, "srun.log"), tasks_write_stdout=False)
        threading.Thread(target=self._watch, name=f"clorch-{plan.job_id}-srun", daemon=True).start()

    def _watch(self) -> None:
        """A rank has ended when its result file is there (it exits right after writing it); every
        rank without one has ended when srun has (with srun's status)."""
        srun = self.srun
        assert srun is not None
        ended: set[int] = set()
        while True:
            code = srun.poll()
            for r in range(self.plan.topology.nproc):
                if r in ended:
                    continue
                result = read_result(self.plan.result_path(r))
                if result is None and code is None:
                    continue
                ended.add(r)
                with self._lock:
                    stopping = r in self._stopping
                if result is not None:
                    self.report(r, 0 if result.ok else 1)
                else:
                    self.report(r, code if code else -15 if stopping else 1)
            if code is not None:
                return
            time.sleep(SRUN_POLL_S)

    def stop(self, ranks: list[int], grace_s: float, wait: bool) -> None:
        """SIGTERM to srun, which ends the whole step at once (one step: its tasks end together);
        SIGKILL and scancel if srun is still there after its own wait for the step
        (:data:`~clorch_repl.placement.srun.SRUN_KILL_WAIT_S`,
        :meth:`clorch_repl.placement.srun.SrunStep.end`). ``grace_s`` changes nothing under srun:
        srun kills its tasks on SIGTERM without a grace of ours."""
        srun = self.srun
        with self._lock:
            self._stopping.update(ranks)
        if srun is None or srun.poll() is not None:
            return
        thread = threading.Thread(target=srun.end, kwargs={"term_wait_s": SRUN_KILL_WAIT_S}, daemon=True,
                                  name=f"clorch-{self.plan.job_id}-stop")
        thread.start()
        if wait:
            thread.join()

    def notes(self) -> str:
        """srun's own output: it may say why (a bad partition, an unshared directory)."""
        said = self.srun.said() if self.srun is not None else ""
        return f"srun said:\n{said}" if said else ""


def rank_pythonpath() -> str:
    """The caller's sys.path, so whatever ``main`` the caller can import, the ranks can (a
    notebook's working directory, a test's folder); the interpreter's own folders are left out."""
    skip = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    seen: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if not os.path.exists(path) or os.path.realpath(path).startswith(skip) or path in seen:
            continue
        seen.append(path)
    return os.pathsep.join(seen)


def for_launcher(name: Any) -> type[JobRanks]:
    """The :class:`JobRanks` of the launcher registered as ``name`` (ConfigError when there is no
    such launcher, or it cannot run batch jobs)."""
    from ..launchers.registry import launcher_class, names

    # The launchers that can run jobs are named without loading any other (a plugin is loaded
    # only when asked for by name: a broken one must not break launch(launcher="local")).
    choice = "'local' or 'slurm'"
    if not isinstance(name, str) or name not in names():
        raise ConfigError(f"launcher must be {choice}; got {name!r}")
    try:
        path = launcher_class(name).batch_ranks
    except (ImportError, AttributeError) as exc:  # a plugin's entry point that does not load
        raise ConfigError(f"the launcher {name!r} could not be loaded ({type(exc).__name__}: {exc})") from None
    if not path:
        raise ConfigError(f"the {name!r} launcher cannot run batch jobs (its ranks are started by a tool outside "
                          f"clorch_repl); launch() takes launcher={choice}")
    module, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, JobRanks)):
        raise ConfigError(f"the {name!r} launcher's batch_ranks ({path}) is not a JobRanks")
    return cls

