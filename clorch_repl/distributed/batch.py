"""Batch jobs: ``launch`` starts one process per rank on this host and returns a :class:`Job`.

Each rank runs in its own session (so its whole process tree can be signalled at once), writes
stdout and stderr at the file-descriptor level (native output included) to a private log file, and
reports its return value or exception through a result file. A monitor thread per job fails fast:
when one rank fails the others are stopped within seconds, and the job names the rank that failed
first (a rank's own error outranks the "peer went away" and timeout errors that follow it).

``jobs()`` and ``get_job(id)`` list the jobs started from this process (``%clorch jobs``). Logs and
results live in a private temporary folder removed at interpreter exit (pass ``log_dir`` to keep
them).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..errors import ClorchError, ConfigError, JobStopped, JobTimeout, RankFailure
from ..procs import LOOPBACK, describe_exit, free_port, tail_bytes, terminate_tree
from ..rank_env import RankPlace, rank_environment, world_environment
from ..launchers import supervisor
from ..launchers.rankfiles import log_tail
from ..topology import Topology, parse_number, resolve_topology
from ..atomic import write_json_atomic
from .results import RankResult, read_result
from ._target import target_spec

logger = logging.getLogger(__name__)

JOB_STATES = ("running", "succeeded", "failed", "timed_out", "stopped")
RANK_STATES = ("running", "succeeded", "failed", "stopped")
LOG_TAIL_ON_FAILURE = 20


@dataclass(frozen=True)
class RankStatus:
    """One rank as ``job.status()`` sees it. ``error`` is the rank's first error line, if any."""

    rank: int
    pid: int | None
    device: str
    state: str
    exit_code: int | None
    exit: str
    error: str | None


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of a job. ``message`` is one line: the cause when it failed or timed out."""

    id: str
    state: str
    main: str
    backend: str
    nproc: int
    elapsed_s: float
    message: str
    first_failed_rank: int | None
    ranks: tuple[RankStatus, ...]

    def summary(self) -> str:
        """One line for a table of jobs (``%clorch jobs``)."""
        text = f"{self.id}  {self.state:<9}  {self.nproc} x {self.backend}  {self.main}  {self.elapsed_s:.1f}s"
        return f"{text}  {self.message}" if self.message else text


class Job:
    """A running or finished batch of ranks. Use as a context manager to stop it on exit."""

    def __init__(self, job_id: str, spec: str, topology: Topology, directory: str, timeout_s: float | None,
                 grace_s: float, owns_dir: bool, launcher: str = "local") -> None:
        self.id = job_id
        #: "local" (one process per rank, each below its supervisor) or "slurm" (one srun step)
        self.launcher = launcher
        self._srun: subprocess.Popen[bytes] | None = None
        self.main = spec
        self.topology = topology
        self.dir = directory
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._owns_dir = owns_dir
        n = topology.nproc
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * n
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

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Block until every rank ends; return their return values in rank order.

        Raises :class:`RankFailure` naming the rank that failed first (with its traceback),
        :class:`JobTimeout` after ``timeout_ms``, :class:`JobStopped` after ``stop()``, and
        ``TimeoutError`` if ``timeout`` seconds pass first (the job keeps running).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.id} is still running after {timeout} s; job.stop() ends it")
        state = self._state
        if state == "succeeded":
            return [result.value() if result else None for result in self._results]
        if state == "failed":
            raise self._failure_error()
        if state == "timed_out":
            raise JobTimeout(f"{self.id} {self._message}")
        raise JobStopped(f"{self.id} was stopped before its ranks finished ({self._message})")

    def logs(self, rank: int, tail: int | None = 200) -> str:
        """The last ``tail`` lines (None: all) of a rank's stdout and stderr, native output included."""
        path = self.log_path(rank)
        if tail is not None and (isinstance(tail, bool) or not isinstance(tail, int) or tail < 0):
            raise ConfigError(f"tail must be a non-negative whole number of lines or None; got {tail!r}")
        try:
            return log_tail(path, tail)  # across a rotation of the capped log (launchers/logcap.py)
        except FileNotFoundError:
            return ""

    def log_path(self, rank: int) -> str:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.topology.nproc:
            raise ConfigError(f"{self.id} has ranks 0..{self.topology.nproc - 1}; got rank {rank!r}")
        return os.path.join(self.dir, f"rank-{rank}.log")

    def stop(self, grace_s: float | None = None) -> JobStatus:
        """End every live rank (its whole process tree): SIGTERM, then SIGKILL after ``grace_s``."""
        with self._lock:
            if not self._done.is_set() and self._reason is None:
                self._reason = "stopped"
                self._message = "stopped by job.stop()"
        self._stop_ranks(grace_s if grace_s is not None else self.grace_s, wait=True)
        self._done.wait(grace_s if grace_s is not None else self.grace_s + 10)
        return self.status()

    def pids(self) -> list[int | None]:
        """Each rank's own Python process (below its supervisor, whose pid ``_procs`` holds)."""
        return [self._rank_pid(r) for r in range(self.topology.nproc)]

    def _pid_path(self, r: int) -> str:
        return os.path.join(self.dir, f"rank-{r}.pid")

    def _rank_pid(self, r: int) -> int | None:
        if self.launcher == "slurm":
            return None  # on its node; Slurm knows it (sstat), this process does not
        proc = self._procs[r]
        if proc is None:
            return None
        pid = supervisor.read_pid(self._pid_path(r))
        # not written yet (or the directory is gone): the supervisor stands in
        return proc.pid if pid is None else pid

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
        return RankStatus(rank=r, pid=self._rank_pid(r), device=self.topology.device_label(r),
                          state=state, exit_code=code, exit=describe_exit(code), error=error)

    def _start_srun(self, command: list[str], env: dict[str, str]) -> None:
        """One srun step runs every rank (``_rank_entry`` reads its place from Slurm's variables);
        srun writes each task's output to ``rank-N.log`` in the job directory, which the nodes
        share with this host (the spec, the results and the rendezvous file live there too)."""
        log = os.open(os.path.join(self.dir, "srun.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._srun = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=log, start_new_session=True, close_fds=True)
        except OSError as exc:
            raise ClorchError(f"{self.id}: could not run srun ({exc})") from exc
        finally:
            os.close(log)
        threading.Thread(target=self._watch_srun, name=f"clorch-{self.id}-srun", daemon=True).start()
        threading.Thread(target=self._monitor, name=f"clorch-{self.id}-monitor", daemon=True).start()

    def _watch_srun(self) -> None:
        """A rank has ended when its result file is there (it exits right after writing it); every
        rank without one has ended when srun has (with srun's status)."""
        srun = self._srun
        assert srun is not None
        n = self.topology.nproc
        while True:
            code = srun.poll()
            changed = False
            with self._lock:
                for r in range(n):
                    if self._exit_codes[r] is not None:
                        continue
                    result = read_result(os.path.join(self.dir, f"rank-{r}.result.json"))
                    if result is not None or code is not None:
                        self._results[r] = result
                        self._exit_times[r] = time.time()
                        if result is not None:
                            self._exit_codes[r] = 0 if result.ok else 1
                        else:
                            self._exit_codes[r] = code if code else -15 if r in self._stopping else 1
                        changed = True
            if changed:
                self._changed.set()
            if code is not None:
                return
            time.sleep(0.2)

    def _start(self, env_for: Callable[[int], dict[str, str]], spec_path: str) -> None:
        # Each rank runs below its own supervisor (clorch_repl.launchers.supervisor): it ends the
        # rank and everything the rank started, setsid daemons included, when the job is stopped
        # or this process dies, even while the rank holds the GIL; it exits with the rank's status.
        rank_cmd = [sys.executable, "-m", "clorch_repl.distributed._rank_entry", spec_path]
        try:
            for r in range(self.topology.nproc):
                # --session-dir only for a directory we own: nobody is left to read it when we are gone
                cmd = supervisor.command(sys.executable, self.grace_s, os.getpid(), rank_cmd,
                                         pid_file=self._pid_path(r), session_dir=self.dir if self._owns_dir else None)
                fd = os.open(self.log_path(r), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
                try:
                    self._procs[r] = subprocess.Popen(cmd, env=env_for(r), stdin=subprocess.DEVNULL, stdout=fd,
                                                      stderr=subprocess.STDOUT, start_new_session=True,
                                                      close_fds=True)
                finally:
                    os.close(fd)
        except OSError as exc:
            self._reason, self._message = "failed", f"could not start the ranks: {exc}"
            self._stop_ranks(0.5, wait=True)
            raise ClorchError(f"{self.id}: could not start rank processes ({exc})") from exc
        for r in range(self.topology.nproc):
            threading.Thread(target=self._wait_rank, args=(r,), name=f"clorch-{self.id}-rank{r}",
                             daemon=True).start()
        threading.Thread(target=self._monitor, name=f"clorch-{self.id}-monitor", daemon=True).start()

    def _wait_rank(self, r: int) -> None:
        proc = self._procs[r]
        assert proc is not None
        code: int | None = None
        waitid = getattr(os, "waitid", None)
        if waitid is not None:
            # WNOWAIT: read the exit status but leave reaping to Popen, so psutil (in
            # terminate_tree) reaping it first cannot turn a SIGKILL into "exit code 0".
            try:
                info = waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                if info is not None:
                    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            except ChildProcessError:
                code = None
        reaped = proc.wait()
        if code is None:
            code = reaped
        with self._lock:
            self._exit_times[r] = time.time()
            self._exit_codes[r] = code
            self._results[r] = read_result(os.path.join(self.dir, f"rank-{r}.result.json"))
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
        """Ask the ranks still running where they are (issue 9's verdict) before stopping them."""
        from ..diagnosis.jobs import explain

        if self.launcher == "slurm":  # the probe signals local pids; these ranks run on the nodes
            self._stop_ranks(self.grace_s)
            return
        try:
            with self._lock:
                pids = {r: self._procs[r].pid for r in live if self._procs[r] is not None}
                exits = {r: describe_exit(c) for r, c in enumerate(self._exit_codes) if c is not None}
            text = explain(self.dir, pids, exits)
            if text:
                with self._lock:
                    self._message = f"{self._message}\nwhy: {text}"
        finally:
            self._stop_ranks(self.grace_s)

    def _stop_ranks(self, grace_s: float, wait: bool = False) -> None:
        if self._srun is not None:
            self._stop_srun(grace_s, wait)
            return
        with self._lock:
            live = [r for r, p in enumerate(self._procs) if p is not None and self._exit_codes[r] is None]
            self._stopping.update(live)
        threads = [threading.Thread(target=terminate_tree, args=(self._procs[r].pid, grace_s), daemon=True)
                   for r in live]
        for t in threads:
            t.start()
        if wait:
            for t in threads:
                t.join()

    def _stop_srun(self, grace_s: float, wait: bool) -> None:
        """SIGTERM to srun, which passes it to every task; SIGKILL after ``grace_s``."""
        srun = self._srun
        assert srun is not None
        with self._lock:
            self._stopping.update(r for r in range(self.topology.nproc) if self._exit_codes[r] is None)
        if srun.poll() is not None:
            return

        def end() -> None:
            srun.terminate()
            try:
                srun.wait(timeout=grace_s + 5.0)  # srun waits Slurm's KillWait for its tasks
            except subprocess.TimeoutExpired:
                logger.warning("clorch_repl: %s: srun outlived SIGTERM by %.0f s; killing it", self.id, grace_s + 5)
                srun.kill()

        thread = threading.Thread(target=end, daemon=True)
        thread.start()
        if wait:
            thread.join()

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
            body = f"last lines of its log:\n{self.logs(r, tail=LOG_TAIL_ON_FAILURE).rstrip()}"
            if self._srun is not None:  # srun itself may say why (a bad partition, an unshared directory)
                try:
                    with open(os.path.join(self.dir, "srun.log"), "rb") as fh:
                        said = tail_bytes(fh, LOG_TAIL_ON_FAILURE).decode(errors="replace").rstrip()
                except FileNotFoundError:
                    said = ""
                if said:
                    body += f"\nsrun said:\n{said}"
        others = [x for x in range(self.topology.nproc) if x != r]
        tail = (f"\n{_ranks_phrase(others).capitalize()} stopped or failed after it. " if others else "\n") + \
            f"Full output: job.logs({r}) (%clorch logs {r} --job {self.id})"
        error = RankFailure(f"{head}\n{body}{tail}", rank=r)
        error.job_id = self.id  # type: ignore[attr-defined]
        error.traceback_text = result.traceback if result else None  # type: ignore[attr-defined]
        return error


def _ranks_phrase(ranks: Sequence[int]) -> str:
    """[1] -> "rank 1 was"; [1, 2] -> "ranks 1,2 were"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} was"
    return f"ranks {','.join(map(str, ranks))} were"


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


def _json_args(args: Any) -> Any:
    try:
        return json.loads(json.dumps(args, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"args cannot be sent to the ranks: they travel as JSON (dicts with string keys, lists, "
                          f"strings, finite numbers, booleans, None) and {exc}; pass paths or plain values "
                          "instead of objects") from None


def _rank_pythonpath() -> str:
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


def _slurm_topology(nproc_per_node: Any, devices: Any, backend: str | None, pg_timeout_s: Any,
                    nodes: Any) -> Topology:
    if devices is not None:
        raise ConfigError("devices is for launcher='local'; under slurm each rank uses its node's GPU LOCAL_RANK")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"nodes must be a whole number >= 1; got {nodes!r}")
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ConfigError(f"launcher='slurm' needs nproc_per_node, a whole number >= 1; got {nproc_per_node!r}")
    chosen = (backend or "gloo").lower()
    if chosen not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be one of nccl, gloo; got {backend!r}")
    timeout = parse_number(pg_timeout_s, "pg_timeout_s", "seconds")
    nproc = nodes * nproc_per_node
    return Topology(nproc=nproc, devices=(None,) * nproc, backend=chosen,
                    timeout_s=timeout if timeout is not None else 600.0)


def launch(nproc_per_node: int | None = None, devices: Sequence[int] | str | None = None,
           main: str | Callable[..., Any] | None = None, args: Any = None, timeout_ms: float | None = None,
           backend: str | None = None, *, env: Mapping[str, str] | None = None, check: bool = False,
           grace_s: float = 5.0, pg_timeout_s: float | None = None, log_dir: str | None = None,
           launcher: str = "local", nodes: int = 1, srun_args: str = "") -> Job:
    """Start one process per rank running ``main`` inside an initialised process group, and
    return the :class:`Job` at once.

    ``launcher="local"`` (the default) runs the ranks on this host; ``launcher="slurm"`` runs
    ``nodes x nproc_per_node`` ranks as one ``srun`` step (``srun_args``: more srun arguments, one
    string), meeting through a FileStore in the job directory, which must therefore be on a
    filesystem the nodes share (give ``log_dir`` there; it also holds results and logs). Under
    slurm ``devices`` is not accepted (each rank takes its node's GPU ``LOCAL_RANK`` with nccl)
    and a timeout stops the job without asking its ranks where they are. A slurm job outlives this
    process if it dies (the ranks run under slurmstepd): ``timeout_ms`` becomes srun's ``--time``.

    ``main`` is "module:function" or an importable function, called in every rank with
    ``{"rank", "local_rank", "world_size", "backend", "process_group", "args"}``. ``args`` travel
    as JSON (tuples arrive as lists, dict keys as strings); return values come back as JSON or,
    failing that, pickled. ``timeout_ms`` bounds the whole job; ``pg_timeout_s`` the collectives
    (default 600 s, never more than ``timeout_ms``). ``check=True`` turns on the collectives'
    cross-rank check in every rank. ``env`` adds variables to every rank. Every mistake is refused
    here, with one line, before a process starts.
    """
    if main is None:
        raise ConfigError("main is required: 'module:function' or an importable function")
    if launcher not in ("local", "slurm"):
        raise ConfigError(f"launcher must be 'local' or 'slurm'; got {launcher!r}")
    if launcher == "slurm":
        topology = _slurm_topology(nproc_per_node, devices, backend, pg_timeout_s, nodes)
        if log_dir is None:
            raise ConfigError("launcher='slurm' needs log_dir on a filesystem the nodes share with this host (the "
                              "job's spec, rendezvous file, results and logs live there); /tmp is not shared")
    else:
        if nodes != 1:
            raise ConfigError(f"nodes={nodes!r} needs launcher='slurm' (a local job runs on this host)")
        topology = resolve_topology(nproc_per_node, devices, backend, pg_timeout_s)
    timeout_ms_number = parse_number(timeout_ms, "timeout_ms", "milliseconds")
    timeout_s = None if timeout_ms_number is None else timeout_ms_number / 1000.0
    spec = target_spec(main)
    payload_args = _json_args(args)
    extra_env = {}
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError(f"env must map strings to strings; got {key!r}: {value!r}")
        extra_env[key] = value
    grace = parse_number(grace_s, "grace_s", "seconds", zero="no grace")
    if grace is None:
        raise ConfigError("grace_s must be 0 (no grace) or a positive number of seconds; got None")

    pg_timeout = topology.timeout_s if timeout_s is None else min(topology.timeout_s, timeout_s)
    with _REGISTRY_LOCK:
        job_id = f"job-{next(_IDS)}"
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        directory, owns = tempfile.mkdtemp(prefix=f"clorch-{job_id}-", dir=log_dir), False
    else:
        directory, owns = tempfile.mkdtemp(prefix=f"clorch-{job_id}-"), True
    os.chmod(directory, 0o700)
    spec_path = os.path.join(directory, "job.json")
    write_json_atomic(spec_path, {"main": spec, "args": payload_args, "dir": directory, "parent_pid": os.getpid(),
                                  "job_id": job_id, "owns_dir": owns})

    port = free_port()
    base = dict(os.environ)
    base.update({"PYTHONPATH": _rank_pythonpath(), "CLORCH_JOB_ID": job_id})
    if check:
        base["CLORCH_DIST_CHECK"] = "1"
    # The rendezvous: a FileStore in the job's private directory, which only this user can open
    # (clorch_repl.rendezvous says what is and is not protected).
    store_file = os.path.join(directory, "rendezvous.store")

    def env_for(r: int) -> dict[str, str]:
        env = rank_environment(RankPlace(
            rank=r, local_rank=r, world_size=topology.nproc, local_world_size=topology.nproc,
            master_addr=LOOPBACK, master_port=port, backend=topology.backend, timeout_s=pg_timeout,
            gpu=topology.visible_devices(r) or None, store_file=store_file, socket_ifname="lo",
            cpu_bind=topology.cpu_bind), base)
        env.update(extra_env)
        return env

    job = Job(job_id, spec, topology, directory, timeout_s, grace, owns, launcher)
    with _REGISTRY_LOCK:
        _JOBS[job_id] = job
    try:
        if launcher == "slurm":
            from ..launchers.slurm import require_srun, srun_command

            require_srun()
            env = world_environment(topology.backend, pg_timeout, store_file, base)
            # The ranks meet through the FileStore (CLORCH_STORE_FILE); torch's env:// names are
            # set all the same, as a local job's are (the store is chosen by MASTER_PORT's match).
            env.update({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)})
            env.update(extra_env)
            # Slurm ends the step at the job's timeout even if this process is gone by then (a
            # killed notebook): the ranks watch slurmstepd, not this process.
            minutes = None if timeout_s is None else str(max(1, math.ceil(timeout_s / 60)))
            command = srun_command(nodes, topology.nproc // nodes, f"clorch-{job_id}", srun_args=srun_args,
                                   output=os.path.join(directory, "rank-%t.log"), time=minutes)
            job._start_srun(command + [sys.executable, "-m", "clorch_repl.distributed._rank_entry", spec_path], env)
        else:
            job._start(env_for, spec_path)
    except BaseException:
        with _REGISTRY_LOCK:  # never started: not a job to list or wait for
            _JOBS.pop(job_id, None)
        raise
    return job
