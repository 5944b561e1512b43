"""Ranks as the tasks of one ``srun`` step: its command line, its process, what it said, its end.

A session's ``slurm`` launcher (:mod:`clorch_repl.launchers.slurm`: one nanny per task) and a batch
job under ``launcher="slurm"`` (:mod:`clorch_repl.jobs.job_ranks`: one job rank per task) both run
one srun step from this process and end it the same way (:meth:`SrunStep.end`): a wait for it to
exit on its own (a session's nannies were told to exit), SIGTERM, SIGKILL, and then ``scancel`` of
the step (:meth:`SrunStep.cancel`), because a killed srun can no longer end its tasks and the step
could live on to its time limit. On SIGTERM srun does not pass the signal on: it forces the step's
end at once (Slurm 22.05 on tests/cluster.py's cluster: "forcing job termination", tasks that
trap SIGTERM "Killed" within milliseconds, srun gone in 20-60 ms) and waits up to KillWait + 2 s
for the step to be over ("Waiting up to 7 seconds for job step to finish" at KillWait=5): a
rank gets no grace of ours under srun.
The printed line ``--launcher attach`` shows for Slurm is written here too (:func:`srun_hint`).

Inside an allocation (``salloc``, an ``sbatch`` job: ``SLURM_JOB_ID`` is set) srun runs a step in
it; outside, srun asks Slurm for one (``--partition``, ``--time``). The two are cancelled
differently: ``srun --job-name`` names the *job* srun asks for outside an allocation, so
``scancel --name`` finds it; inside one it names only the *step*, and ``scancel --name`` matches
job names alone ("No active jobs match ALL job filters"), so the step is looked up by its name in
``squeue --steps -j $SLURM_JOB_ID`` and cancelled by its id, ``JOBID.STEPID``. Tried on the real
two-node Slurm 22.05 cluster of tests/cluster.py (tests/integration/test_srun_step.py): a step
inside a ``salloc --no-shell`` allocation, srun alive, is not touched by ``scancel --name`` and is
ended by :meth:`SrunStep.cancel`. There a SIGKILLed srun's step was also ended by Slurm itself
within about 2 s (slurmd logs "STEP CANCELLED"); the cancel is for the Slurm versions and
configurations where it is not, and costs one squeue when it is.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import shutil
import subprocess
from typing import Mapping

from ..common.procs import tail_bytes
from ..errors import ClorchError, ConfigError

logger = logging.getLogger(__name__)

#: How long srun gets, after our SIGTERM, to see its step over: srun's own wait then, Slurm's
#: KillWait + 2 s (see the module docstring), at Slurm's default KillWait of 30 s. A healthy step
#: is over in milliseconds; srun takes this long only when a node cannot be reached, and a shorter
#: wait would SIGKILL it (with a warning) in the middle of its own end of the step. Where a
#: cluster sets KillWait longer, srun gets its SIGKILL and the step its scancel after this. The
#: one value for a session's launcher and a batch job (their stop's grace changes nothing here).
SRUN_KILL_WAIT_S = 32.0
#: How long ``squeue``/``scancel`` may take before the cancel gives up and says what to check.
SLURM_QUERY_S = 10.0
#: Lines of srun's own output that :meth:`SrunStep.said` gives (a failure it may explain: a bad
#: partition, a directory the nodes do not share).
SAID_LINES = 20


def task_layout(nodes: int, tasks_per_node: int) -> list[tuple[str, str]]:
    """srun's options for ``nodes`` x ``tasks_per_node`` tasks, as (option, value): the one place
    both :func:`srun_command` and the printed :func:`srun_hint` take them from, so they cannot drift."""
    return [("--nodes", str(nodes)), ("--ntasks-per-node", str(tasks_per_node))]


def srun_command(nodes: int, tasks_per_node: int, job_name: str, *, partition: str | None = None,
                 time: str | None = None, srun_args: str = "", output: str | None = None) -> list[str]:
    """``srun`` with one task per rank (the session's nannies and ``launch()``'s batch ranks);
    ``srun_args`` is the user's string of more arguments, split as a shell would."""
    cmd = ["srun", *(f"{opt}={value}" for opt, value in task_layout(nodes, tasks_per_node)),
           f"--ntasks={nodes * tasks_per_node}", "--kill-on-bad-exit=0", f"--job-name={job_name}"]
    if partition:
        cmd.append(f"--partition={partition}")
    if time:
        cmd.append(f"--time={time}")
    if output:
        cmd.append(f"--output={output}")
    try:
        cmd += shlex.split(srun_args)
    except ValueError as exc:
        raise ConfigError(f"srun_args cannot be split like a shell line: {exc}") from None
    return cmd


def srun_hint(nodes: int, tasks_per_node: int, program: str = "python -m clorch_repl.rank") -> str:
    """The srun line a user runs by hand (``--launcher attach`` prints it): the same task layout
    as :func:`srun_command`'s (:func:`task_layout`), in the short form people type."""
    layout = " ".join(f"{opt} {value}" for opt, value in task_layout(nodes, tasks_per_node))
    return f"srun {layout} {program}"


def time_limit(timeout_s: float | None) -> str | None:
    """srun's ``--time`` (whole minutes, at least one) for a job that may run ``timeout_s``
    seconds; None: no limit of ours (the partition's)."""
    return None if timeout_s is None else str(max(1, math.ceil(timeout_s / 60)))


def require_srun() -> None:
    """Refuse, before anything starts, on a host without Slurm's client tools."""
    if shutil.which("srun") is None:
        raise ClorchError("the slurm launcher needs srun on this host's PATH (Slurm's client tools)")


def allocation_of(env: Mapping[str, str]) -> str | None:
    """The allocation an srun run with ``env`` places its step in (``SLURM_JOB_ID``, or the older
    ``SLURM_JOBID`` srun also reads), None outside one (srun then asks for a job of its own)."""
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def step_ids(squeue_steps: str, name: str) -> list[str]:
    """The ids (``JOBID.STEPID``) of the steps named ``name`` in the lines of
    ``squeue --steps -h -o "%i %j"``."""
    ids = []
    for line in squeue_steps.splitlines():
        fields = line.split(None, 1)
        if len(fields) == 2 and fields[1].strip() == name:
            ids.append(fields[0])
    return ids


class SrunStep:
    """One srun step started by this process (see the module docstring). ``name`` is its
    ``--job-name`` (the job's name outside an allocation, the step's inside one); ``what`` names
    the step in messages (the job's id, the session's); ``env`` is srun's environment, whose
    ``SLURM_JOB_ID`` says whether the step runs in an allocation (and squeue and scancel talk to
    the cluster srun did)."""

    def __init__(self, process: subprocess.Popen[bytes], name: str, what: str, log_path: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.process = process
        self.name = name
        self.what = what
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.allocation = allocation_of(self.env)

    @classmethod
    def start(cls, command: list[str], *, env: Mapping[str, str], log_path: str, name: str, what: str,
              tasks_write_stdout: bool = True) -> SrunStep:
        """Run ``command`` (an :func:`srun_command` and the program) in a session of its own (a
        Ctrl-C of the caller's terminal does not reach it), srun's own stderr appended to
        ``log_path`` (0600). ``tasks_write_stdout=False`` where the tasks' output goes to files of
        their own (``--output``). ClorchError, naming ``what``, when srun cannot be run."""
        require_srun()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            process = subprocess.Popen(command, env=dict(env), stdin=subprocess.DEVNULL,
                                       stdout=log if tasks_write_stdout else subprocess.DEVNULL, stderr=log,
                                       start_new_session=True, close_fds=True)
        except OSError as exc:
            raise ClorchError(f"{what}: could not run srun ({exc})") from exc
        finally:
            os.close(log)
        return cls(process, name, what, log_path, env)

    def poll(self) -> int | None:
        """srun's exit status once it has ended (negative: killed by that signal), else None."""
        return self.process.poll()

    def said(self, lines: int = SAID_LINES) -> str:
        """The last ``lines`` lines srun wrote ("" when nothing): it may say why a step failed."""
        try:
            with open(self.log_path, "rb") as fh:
                return tail_bytes(fh, lines).decode(errors="replace").strip()
        except FileNotFoundError:
            return ""

    def end(self, *, term_wait_s: float, exit_wait_s: float = 0.0, expected_exit: bool = False) -> None:
        """End the step: up to ``exit_wait_s`` for srun to exit on its own (``expected_exit``:
        its tasks were told to exit, so a longer wait is worth a warning), then SIGTERM and up to
        ``term_wait_s`` for srun to end its tasks (:data:`SRUN_KILL_WAIT_S`), then SIGKILL and
        :meth:`cancel` (a killed srun can leave its step running)."""
        process = self.process
        if process.poll() is not None:
            return
        if exit_wait_s > 0:
            try:
                process.wait(timeout=exit_wait_s)
                return
            except subprocess.TimeoutExpired:
                if expected_exit:
                    logger.warning("clorch_repl: %s: srun did not exit %.0f s after its ranks were told to; "
                                   "terminating it", self.what, exit_wait_s)
        process.terminate()
        try:
            process.wait(timeout=term_wait_s)
            return
        except subprocess.TimeoutExpired:
            logger.warning("clorch_repl: %s: srun outlived SIGTERM by %.0f s; killing it and cancelling its step",
                           self.what, term_wait_s)
        process.kill()
        process.wait()
        self.cancel()

    def cancel(self) -> None:
        """The backstop after a killed srun (its tasks may run on under slurmstepd): outside an
        allocation ``scancel --name`` (the job srun asked for bears the name); inside one the
        step's id from ``squeue --steps`` and ``scancel JOBID.STEPID`` (``--name`` matches job
        names only: see the module docstring). A failure is logged with what to check."""
        if self.allocation is None:
            where = f"squeue for a job named {self.name} and scancel it"
            targets = [f"--name={self.name}"]
        else:
            where = f"squeue --steps -j {self.allocation} for a step named {self.name} and scancel JOBID.STEPID"
            steps = self._slurm("squeue", ["--steps", "-j", self.allocation, "-h", "-o", "%i %j"], where)
            if steps is None:
                return
            targets = step_ids(steps, self.name)
            if not targets:
                logger.info("clorch_repl: %s: step %s of allocation %s is already gone", self.what, self.name,
                            self.allocation)
                return
        if self._slurm("scancel", targets, where) is not None:
            logger.info("clorch_repl: %s: scancel %s", self.what, " ".join(targets))

    def _slurm(self, tool: str, args: list[str], where: str) -> str | None:
        """``tool args`` with srun's environment: its output, or None (logged, saying to check
        ``where`` by hand) when it is missing, fails or exits with an error."""
        exe = shutil.which(tool)
        if exe is None:
            logger.warning("clorch_repl: %s: no %s on PATH to cancel srun's step; check %s", self.what, tool, where)
            return None
        try:
            done = subprocess.run([exe, *args], env=self.env, timeout=SLURM_QUERY_S, check=False,
                                  capture_output=True, text=True)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("clorch_repl: %s: %s failed (%s); check %s", self.what, tool, exc, where)
            return None
        if done.returncode != 0:
            logger.warning("clorch_repl: %s: %s %s exited %d (%s); check %s", self.what, tool, " ".join(args),
                           done.returncode, done.stderr.strip() or "no message", where)
            return None
        return done.stdout
