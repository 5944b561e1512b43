"""Ranks as the tasks of one ``srun`` step: its command line, its process, what it said, its end.

A session's ``slurm`` launcher (:mod:`clorch_repl.launchers.slurm`: one nanny per task) and a batch
job under ``launcher="slurm"`` (:mod:`clorch_repl.jobs.job_ranks`: one job rank per task) both run
one srun step from this process and end it the same way (:meth:`SrunStep.end`): a wait for it to
exit on its own (a session's nannies were told to exit), SIGTERM (srun passes it to every task and
waits Slurm's KillWait for them), SIGKILL, and then ``scancel`` by the step's job name, because a
killed srun can no longer end its tasks and the step would live on to its time limit. The printed
line ``--launcher attach`` shows for Slurm is written here too (:func:`srun_hint`).

Inside an allocation (``salloc``, an ``sbatch`` job: ``SLURM_JOB_ID`` is set) srun runs a step in
it; outside, srun asks Slurm for one (``--partition``, ``--time``).
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

#: Lines of srun's own output that :meth:`SrunStep.said` gives (a failure it may explain: a bad
#: partition, a directory the nodes do not share).
SAID_LINES = 20


def srun_command(nodes: int, tasks_per_node: int, job_name: str, *, partition: str | None = None,
                 time: str | None = None, srun_args: str = "", output: str | None = None) -> list[str]:
    """``srun`` with one task per rank (the session's nannies and ``launch()``'s batch ranks);
    ``srun_args`` is the user's string of more arguments, split as a shell would."""
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}", f"--ntasks={nodes * tasks_per_node}",
           "--kill-on-bad-exit=0", f"--job-name={job_name}"]
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
    as :func:`srun_command`'s, in the short form people type."""
    return f"srun --nodes {nodes} --ntasks-per-node {tasks_per_node} {program}"


def time_limit(timeout_s: float | None) -> str | None:
    """srun's ``--time`` (whole minutes, at least one) for a job that may run ``timeout_s``
    seconds; None: no limit of ours (the partition's)."""
    return None if timeout_s is None else str(max(1, math.ceil(timeout_s / 60)))


def require_srun() -> None:
    """Refuse, before anything starts, on a host without Slurm's client tools."""
    if shutil.which("srun") is None:
        raise ClorchError("the slurm launcher needs srun on this host's PATH (Slurm's client tools)")


def first_node_address() -> str | None:
    """A node's address from ``scontrol show nodes`` (NodeAddr), None when there is none to be
    had: a session's notebook listens on the interface that routes to it."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "nodes", "-o"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("scontrol show nodes failed: %s", exc)
        return None
    for field in out.split():
        if field.startswith("NodeAddr="):
            return field.partition("=")[2]
    return None


class SrunStep:
    """One srun step started by this process (see the module docstring). ``name`` is the step's
    ``--job-name`` (``scancel --name`` finds it by that); ``what`` names the step in messages
    (the job's id, the session's)."""

    def __init__(self, process: subprocess.Popen[bytes], name: str, what: str, log_path: str) -> None:
        self.process = process
        self.name = name
        self.what = what
        self.log_path = log_path

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
        return cls(process, name, what, log_path)

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
        ``term_wait_s`` for srun to end its tasks, then SIGKILL and ``scancel --name`` (a killed
        srun leaves its step running)."""
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
        """``scancel --name``: the backstop after a killed srun (the step's tasks run on under
        slurmstepd); a failure is logged with what to check."""
        exe = shutil.which("scancel")
        if exe is None:
            logger.warning("clorch_repl: %s: no scancel on PATH; check squeue for a %s job", self.what, self.name)
            return
        try:
            subprocess.run([exe, f"--name={self.name}"], timeout=10, check=False, capture_output=True)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("clorch_repl: %s: scancel failed (%s); check squeue for a %s job", self.what, exc,
                           self.name)
