"""Batch jobs: ``launch`` starts one process per rank and returns a :class:`Job`.

Each rank runs in its own session (so its whole process tree can be signalled at once), writes
stdout and stderr at the file-descriptor level (native output included) to a private log file, and
reports its return value or exception through a result file. Where the ranks run is the named
launcher's (:mod:`.job_ranks`: this host, or one srun step). A monitor thread per job fails fast:
when one rank fails the others are stopped within seconds, and the job names the rank that failed
first (a rank's own error outranks the "peer went away" and timeout errors that follow it).

``jobs()`` and ``get_job(id)`` list the jobs started from this process (``%clorch jobs``). Logs and
results live in a private temporary folder removed at interpreter exit (pass ``log_dir`` to keep
them); the folders of a process killed outright are swept by the next ``launch`` (:mod:`.job_dirs`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import os
import shutil
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from ..common import env_vars
from ..common.atomic import write_json_atomic
from ..errors import ConfigError, JobStillRunning, JobStopped, JobTimeout, RankFailure
from ..host.rankfiles import log_tail
from ..host.supervisor import STOP_GRACE_S
from ..common.procs import describe_exit
from ..common.workdir import working_directory
from ..common.rank_sets import rank_words
from ..common.topology import parse_number
from ..common.user_frames import public, shown_from_users_code
from .job_dirs import job_directory, sweep_stale
from .job_inputs import extra_env, what_to_run
from .job_ranks import JobPlan, JobRanks, for_launcher, rank_pythonpath
from .job_status import JobStatus, RankStatus
from ..wire.results import RankResult, read_result

logger = logging.getLogger(__name__)

LOG_TAIL_ON_FAILURE = 20


class Job:
    """A running or finished batch of ranks. Use as a context manager to stop it on exit."""

    def __init__(self, plan: JobPlan, main: str, kind: type[JobRanks]) -> None:
        self.id = plan.job_id
        #: the launcher the ranks run under ("local": this host; "slurm": one srun step)
        self.launcher = kind.name
        self.main = main
        self.topology = plan.topology
        self.dir = plan.directory
        self._plan = plan  # the job's files are named there (log_path, result_path)
        self.timeout_s = plan.timeout_s
        self.grace_s = plan.grace_s
        self._owns_dir = plan.owns_dir
        n = plan.topology.nproc
        self._exit_codes: list[int | None] = [None] * n
        self._exit_times: list[float | None] = [None] * n
        self._results: list[RankResult | None] = [None] * n
        self._stopping: set[int] = set()
        self._lock = threading.RLock()
        self._changed = threading.Event()
        self._done = threading.Event()
        self._state = "running"
        self._reason: str | None = None  # "failed" | "timed_out" | "stopped" once the job is ending
        self._first_failed: int | None = None
        self._message = ""
        self._started = time.monotonic()
        self._ended: float | None = None
        self._ranks = kind(plan, self._rank_ended)

    def _begin(self) -> None:
        """Start the ranks, then the monitor (ClorchError, nothing left running, when they cannot)."""
        self._ranks.start()
        threading.Thread(target=self._monitor, name=f"clorch-{self.id}-monitor", daemon=True).start()

    # -- public -------------------------------------------------------------------------------

    def status(self) -> JobStatus:
        """The job's state and every rank's pid, state, exit code and first error, right now."""
        with self._lock:
            ranks = tuple(self._rank_status(r) for r in range(self.topology.nproc))
            end = self._ended if self._ended is not None else time.monotonic()
            first = self._first_failed if self._state == "failed" else None
            return JobStatus(id=self.id, state=self._state, main=self.main, backend=self.topology.backend,
                             nproc=self.topology.nproc, elapsed_s=round(end - self._started, 3),
                             message=self._message, first_failed_rank=first, ranks=ranks)

    def summary(self) -> str:
        """One line for ``%clorch jobs``."""
        return self.status().summary()

    @property
    def state(self) -> str:
        return self._state

    def done(self) -> bool:
        return self._done.is_set()

    @public
    def wait(self, timeout: float | None = None) -> list[Any]:
        """Block until every rank ends; return their return values in rank order.

        Raises :class:`RankFailure` naming the rank that failed first (with its traceback),
        :class:`JobTimeout` after ``timeout_ms``, :class:`JobStopped` after ``stop()``, and
        :class:`JobStillRunning` (a ``TimeoutError``) if ``timeout`` seconds pass first (the job
        keeps running). A Ctrl-C while it waits is a plain KeyboardInterrupt saying that the job
        keeps running, shown (in IPython) from the caller's line: where the interrupt landed (the
        lock this waits on) says nothing.
        """
        try:
            ended = self._done.wait(timeout)
        except KeyboardInterrupt:
            stopped = KeyboardInterrupt(f"{self.id} keeps running; job.wait() waits again, job.stop() ends it")
            raise shown_from_users_code(stopped) from None
        if not ended:
            raise JobStillRunning(f"{self.id} is still running after {timeout:g} s; job.stop() ends it")
        state = self._state
        if state == "succeeded":
            return [result.value() if result else None for result in self._results]
        if state == "failed":
            raise self._failure_error()
        if state == "timed_out":
            raise JobTimeout(f"{self.id} {self._message}")
        raise JobStopped(f"{self.id} was stopped before its ranks finished ({self._message})")

    @public
    def logs(self, rank: int, tail: int | None = 200) -> str:
        """The last ``tail`` lines (None: all) of a rank's stdout and stderr, native output included."""
        path = self.log_path(rank)
        if tail is not None and (isinstance(tail, bool) or not isinstance(tail, int) or tail < 0):
            raise ConfigError(f"tail must be a non-negative whole number of lines or None; got {tail!r}")
        try:
            return log_tail(path, tail)  # across a rotation of the capped log (host/logcap.py)
        except FileNotFoundError:
            return ""

    def log_path(self, rank: int) -> str:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.topology.nproc:
            raise ConfigError(f"{self.id} has {rank_words(range(self.topology.nproc))}; got rank {rank!r}")
        return self._plan.log_path(rank)

    @public
    def stop(self, grace_s: float | None = None) -> JobStatus:
        """End every live rank (its whole process tree): SIGTERM, then SIGKILL after ``grace_s``.
        Under ``launcher="slurm"`` there is no such grace: srun ends its step at once on SIGTERM
        (:mod:`clorch_repl.placement.srun`)."""
        with self._lock:
            if not self._done.is_set() and self._reason is None:
                self._reason = "stopped"
                self._message = "stopped by job.stop()"
        self._stop_ranks(grace_s if grace_s is not None else self.grace_s, wait=True)
        self._done.wait(grace_s if grace_s is not None else self.grace_s + 10)
        return self.status()

    def pids(self) -> list[int | None]:
        """Each rank's process on this host: its own Python process once its supervisor has
        written the pid file, its supervisor's before that; None where it runs elsewhere (srun's
        nodes). A rank that has ended keeps its last pid here (``status()`` says it ended)."""
        return [self._ranks.pid(r) for r in range(self.topology.nproc)]

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._done.is_set():
            self.stop()

    def __repr__(self) -> str:
        end = self._ended if self._ended is not None else time.monotonic()
        text = (f"<Job {self.id} {self._state}: {self.topology.nproc} ranks ({self.topology.backend}) "
                f"main={self.main} {end - self._started:.1f}s")
        return f"{text}: {self._message}>" if self._message else f"{text}>"

    # -- internals ----------------------------------------------------------------------------

    def _rank_status(self, r: int) -> RankStatus:
        code = self._exit_codes[r]
        result = self._results[r]
        error = result.error_line if result is not None and not result.ok else None
        if code is None:
            state = "running"
        elif result is not None and result.ok and code == 0:
            state = "succeeded"
        elif result is not None and not result.ok:
            state = "failed"
        elif r in self._stopping:
            state = "stopped"
        else:
            state = "failed"
            error = error or (f"exited ({describe_exit(code)}) without reporting a result" if code == 0
                              else describe_exit(code))
        return RankStatus(rank=r, pid=self._ranks.pid(r), device=self.topology.device_label(r),
                          state=state, exit_code=code, exit=describe_exit(code), error=error)

    def _rank_ended(self, r: int, code: int) -> None:
        """``JobRanks``' report: rank ``r`` has ended with ``code``; its result file says how."""
        with self._lock:
            self._exit_times[r] = time.time()
            self._exit_codes[r] = code
            self._results[r] = read_result(self._plan.result_path(r))
        self._changed.set()

    def _monitor(self) -> None:
        deadline = None if self.timeout_s is None else self._started + self.timeout_s
        while True:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._changed.wait(wait_s)
            self._changed.clear()
            with self._lock:
                exited = [c is not None for c in self._exit_codes]
                if all(exited):
                    self._finish()
                    return
                if self._reason is None:
                    failed = [r for r in range(self.topology.nproc)
                              if exited[r] and self._rank_status(r).state == "failed"]
                    if failed:
                        self._reason = "failed"
                    elif deadline is not None and time.monotonic() >= deadline:
                        self._reason = "timed_out"
                        live = [r for r in range(self.topology.nproc) if not exited[r]]
                        self._message = (f"timed out after {self.timeout_s:g} s (timeout_ms="
                                         f"{int(self.timeout_s * 1000)}); {_ranks_phrase(live)} still running "
                                         "and stopped; raise timeout_ms if the work needs longer")
                    if self._reason == "timed_out":  # say why it hung, then stop it
                        threading.Thread(target=self._explain_then_stop, args=(live,), daemon=True).start()
                    elif self._reason is not None:
                        threading.Thread(target=self._stop_ranks, args=(self.grace_s,), daemon=True).start()
            if deadline is not None and self._reason is not None:
                deadline = None

    def _explain_then_stop(self, live: list[int]) -> None:
        """Ask the ranks still running where they are (issue 9's verdict) before stopping them;
        ranks that do not serve the probe here (srun's, on their nodes) are stopped at once."""
        from ..diagnosis.jobs import explain

        try:
            if not self._ranks.probed:
                return
            with self._lock:
                pids = {r: self._ranks.pid(r) for r in live}
                exits = {r: describe_exit(c) for r, c in enumerate(self._exit_codes) if c is not None}
            text = explain(self.dir, pids, exits)
            if text:
                with self._lock:
                    self._message = f"{self._message}\nwhy: {text}"
        finally:
            self._stop_ranks(self.grace_s)

    def _stop_ranks(self, grace_s: float, wait: bool = False) -> None:
        with self._lock:
            live = [r for r in range(self.topology.nproc) if self._exit_codes[r] is None]
            self._stopping.update(live)
        self._ranks.stop(live, grace_s, wait)

    def _finish(self) -> None:
        statuses = [self._rank_status(r) for r in range(self.topology.nproc)]
        failed = [s.rank for s in statuses if s.state == "failed"]
        if self._reason == "stopped":
            self._state = "failed" if failed and not self._stopped_only(failed) else "stopped"
        elif self._reason == "timed_out":
            self._state = "timed_out"
        elif failed:
            self._state = "failed"
        else:
            self._state = "succeeded"
        if self._state == "failed":
            self._first_failed = self._pick_first(failed)
            status = statuses[self._first_failed]
            others = [r for r in range(self.topology.nproc) if r != self._first_failed]
            self._message = f"rank {self._first_failed} failed first: {status.error}"
            if others:
                self._message += f"; {_ranks_phrase(others)} stopped or failed after it"
        self._ended = time.monotonic()
        self._done.set()

    def _stopped_only(self, failed: list[int]) -> bool:
        """After a user stop, ranks that "failed" only because they were being stopped don't count."""
        return all(r in self._stopping and (self._results[r] is None or self._results[r].cascade) for r in failed)

    def _pick_first(self, failed: list[int]) -> int:
        """The cause, not the cascade: a rank's own error beats "peer went away"/timeout errors;
        among equals, the earliest."""

        def key(r: int) -> tuple[int, float]:
            result = self._results[r]
            cascade = bool(result is not None and result.cascade)
            when = result.failed_at if result is not None and result.failed_at else (self._exit_times[r] or math.inf)
            return (1 if cascade else 0, when)

        return min(failed, key=key)

    def _failure_error(self) -> RankFailure:
        r = self._first_failed
        assert r is not None
        result = self._results[r]
        status = self._rank_status(r)
        head = f"rank {r} failed first in {self.id} ({self.main}): {status.error}"
        if result is not None and result.traceback:
            body = result.traceback.rstrip()
        else:
            log = self.logs(r, tail=LOG_TAIL_ON_FAILURE).rstrip()
            body = f"last lines of its log:\n{log}" if log.strip() else "its log is empty: it wrote nothing"
            notes = self._ranks.notes()  # the launcher may say why (srun: a bad partition, an unshared directory)
            if notes:
                body += f"\n{notes}"
        others = [x for x in range(self.topology.nproc) if x != r]
        tail = (f"\n{_ranks_phrase(others).capitalize()} stopped or failed after it. " if others else "\n") + \
            f"Full output: job.logs({r}) (%clorch logs {r} --job {self.id})"
        error = RankFailure(f"{head}\n{body}{tail}", rank=r)
        error.job_id = self.id  # type: ignore[attr-defined]
        error.traceback_text = result.traceback if result else None  # type: ignore[attr-defined]
        return error


def _ranks_phrase(ranks: Sequence[int]) -> str:
    """[1] -> "rank 1 was"; [1, 2] -> "ranks 1,2 were"."""
    return f"{rank_words(ranks)} {'was' if len(set(ranks)) == 1 else 'were'}"


# ---------------------------------------------------------------------------------------------
# Registry


_JOBS: dict[str, Job] = {}
_IDS = itertools.count(1)
_REGISTRY_LOCK = threading.Lock()


def jobs() -> list[Job]:
    """The jobs started from this process, oldest first."""
    with _REGISTRY_LOCK:
        return list(_JOBS.values())


def get_job(job_id: str | int) -> Job:
    """A job by id: "job-3", "3" or 3."""
    key = str(job_id).strip()
    if key.isdigit():
        key = f"job-{int(key)}"
    with _REGISTRY_LOCK:
        job = _JOBS.get(key)
        known = ", ".join(_JOBS) or "none"
    if job is None:
        raise ConfigError(f"no job {job_id!r}; jobs started in this process: {known}")
    return job


@atexit.register
def _cleanup() -> None:
    for job in jobs():
        if not job.done():
            try:
                job.stop(grace_s=1.0)
            except Exception:  # noqa: BLE001 - exiting: every other job must still be stopped
                logger.warning("clorch_repl: stopping batch job %s at exit failed", job.id, exc_info=True)
        if job._owns_dir:
            shutil.rmtree(job.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# launch


@public
def launch(nproc_per_node: int | None = None, devices: Sequence[int] | str | None = None,
           main: str | Callable[..., Any] | None = None, args: Any = None, timeout_ms: float | None = None,
           backend: str | None = None, *, env: Mapping[str, str] | None = None, check: bool = False,
           grace_s: float = STOP_GRACE_S, pg_timeout_s: float | None = None, log_dir: str | None = None,
           launcher: str = "local", nodes: int = 1, srun_args: str = "",
           script: str | os.PathLike[str] | None = None, module: str | None = None) -> Job:
    """Start one process per rank running ``main`` inside an initialised process group, and
    return the :class:`Job` at once.

    ``launcher="local"`` (the default) runs the ranks on this host; ``launcher="slurm"`` runs
    ``nodes x nproc_per_node`` ranks as one ``srun`` step (``srun_args``: more srun arguments, one
    string), meeting through a FileStore in the job directory, which must therefore be on a
    filesystem the nodes share (give ``log_dir`` there; it also holds results and logs). Under
    slurm ``devices`` is not accepted (each rank takes its node's GPU ``LOCAL_RANK`` with nccl)
    and a timeout stops the job without asking its ranks where they are. A slurm job outlives this
    process if it dies (the ranks run under slurmstepd): ``timeout_ms`` becomes srun's ``--time``.
    Launchers are looked up by name (:mod:`.job_ranks`), as ``%clorch start --launcher`` does.

    ``main`` is "module:function" or an importable function, called in every rank with
    ``{"rank", "local_rank", "world_size", "backend", "process_group", "args"}``. ``args`` travel
    as JSON (tuples arrive as lists, dict keys as strings); return values come back as JSON or,
    failing that, pickled. ``timeout_ms`` bounds the whole job; ``pg_timeout_s`` the collectives
    (default 600 s, never more than ``timeout_ms``). ``check=True`` turns on the collectives'
    cross-rank check in every rank. ``env`` adds variables to every rank. Every mistake is refused
    here, with one line, before a process starts.

    ``script="train.py"`` (or ``module="pkg.train"``) instead of ``main`` runs a torchrun script
    as ``python train.py ARGS`` in every rank, ``args`` being its command line (a list of strings):
    what ``torchrun --nproc-per-node N train.py ARGS`` runs, with torchrun's variables and GPU
    convention (every rank sees its host's GPUs, its own at ``cuda:{LOCAL_RANK}``). The group is
    formed before the script starts; its own ``init_process_group`` is accepted and its
    ``destroy_process_group`` keeps the group, as under ``%clorch run``. Its ranks return None.
    """
    kind = for_launcher(launcher)
    topology = kind.topology(nproc_per_node, devices, backend, pg_timeout_s, nodes, log_dir)
    timeout_ms_number = parse_number(timeout_ms, "timeout_ms", "milliseconds")
    timeout_s = None if timeout_ms_number is None else timeout_ms_number / 1000.0
    working_directory()  # the ranks start in it: one deleted under the notebook is refused here, saying so
    runs, label = what_to_run(main, script, module, args)
    extra = extra_env(env)
    grace = parse_number(grace_s, "grace_s", "seconds", zero="no grace")
    if grace is None:
        raise ConfigError("grace_s must be 0 (no grace) or a positive number of seconds; got None")

    with _REGISTRY_LOCK:
        job_id = f"job-{next(_IDS)}"
    sweep_stale()  # the folders of jobs whose notebook was killed (.job_dirs): no later chance to remove them
    directory, owns = job_directory(job_id, log_dir)
    spec_path = os.path.join(directory, "job.json")
    write_json_atomic(spec_path, {**runs, "dir": directory, "parent_pid": os.getpid(), "job_id": job_id,
                                  "owns_dir": owns})
    base = dict(os.environ)
    base.update({"PYTHONPATH": rank_pythonpath(), env_vars.JOB_ID.name: job_id})
    if check:
        base[env_vars.DIST_CHECK.name] = "1"
    plan = JobPlan(job_id=job_id, directory=directory, spec_path=spec_path, topology=topology, base_env=base,
                   extra_env=extra, timeout_s=timeout_s, grace_s=grace, owns_dir=owns,
                   pg_timeout_s=topology.timeout_s if timeout_s is None else min(topology.timeout_s, timeout_s),
                   nodes=nodes, srun_args=srun_args, torchrun_gpus="main" not in runs)
    job = Job(plan, label, kind)
    with _REGISTRY_LOCK:
        _JOBS[job_id] = job
    try:
        job._begin()
    except BaseException:
        with _REGISTRY_LOCK:  # never started: not a job to list or wait for
            _JOBS.pop(job_id, None)
        raise
    return job
