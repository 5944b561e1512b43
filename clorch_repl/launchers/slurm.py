"""The ``slurm`` launcher: ``srun`` starts ``python -m clorch_repl.rank`` on the nodes.

Inside an allocation (``salloc``, an ``sbatch`` job: ``SLURM_JOB_ID`` is set) srun runs a step in
it; outside, srun asks Slurm for one (``--partition``, ``--time``). The nannies never exit because
a kernel died, so the step (and the allocation) lives until ``%clorch stop``: then every nanny is
told to exit, srun sees its tasks end and exits, and only if it does not within
:data:`SRUN_EXIT_S` is it sent SIGTERM (srun passes it to the tasks), then SIGKILL.

The nodes run the notebook's own Python (``sys.executable``): on a cluster that is a shared
filesystem's virtual environment, as for any srun of a Python program. The connect info reaches the
tasks in their environment (``CLORCH_CONNECT``; srun passes the notebook's environment on), so no
file has to be shared for it.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys

from ..errors import ClorchError, ConfigError
from .base import Progress
from ..wire.connect import CONNECT_ENV, CONNECT_FILE_ENV, route_address
from .callback import default_listen_address
from .remote import RemoteLauncher

logger = logging.getLogger(__name__)

#: How long srun gets to exit on its own after the nannies were told to exit.
SRUN_EXIT_S = 10.0


def _first_node_address() -> str | None:
    """A node's address from ``scontrol show nodes`` (NodeAddr): the notebook listens on the
    interface that routes to it."""
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


def srun_command(nodes: int, tasks_per_node: int, job_name: str, *, partition: str | None = None,
                 time: str | None = None, srun_args: str = "", output: str | None = None) -> list[str]:
    """``srun`` with one task per rank (the session's nannies and ``launch()``'s batch ranks)."""
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


def require_srun() -> None:
    if shutil.which("srun") is None:
        raise ClorchError("the slurm launcher needs srun on this host's PATH (Slurm's client tools)")


class SlurmLauncher(RemoteLauncher):
    """Ranks as the tasks of one srun step (see the module docstring)."""

    name = "slurm"
    batch_ranks = "clorch_repl.jobs.job_ranks:SlurmJobRanks"

    def default_listen(self) -> str:
        node = _first_node_address()
        if node:
            try:
                return route_address(node)
            except OSError as exc:
                logger.info("no route to node address %s: %s", node, exc)
        return default_listen_address()

    def command(self) -> list[str]:
        opts = self.options
        assert opts.nproc_per_node is not None
        return srun_command(opts.nodes, opts.nproc_per_node, f"clorch-{self.server.info.session}",
                            partition=opts.partition, time=opts.time, srun_args=opts.srun_args) + [
            sys.executable, "-m", "clorch_repl.rank"]

    def begin(self, progress: Progress) -> None:
        require_srun()
        # srun hands every task this environment: the nodes need no shared filesystem for it
        env = dict(os.environ, **{CONNECT_ENV: self.server.info.dumps(), CONNECT_FILE_ENV: self.connect_file})
        self.log_path = os.path.join(self.dir, "srun.log")
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.srun = subprocess.Popen(self.command(), env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            os.close(log)
        progress(f"srun started ({self.options.nodes} node(s) x {self.options.nproc_per_node}); waiting for the "
                 "ranks to call back")

    def _srun_says(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()[-2000:].strip()
        except OSError:
            return ""

    def still_coming(self) -> str | None:
        code = self.srun.poll()
        if code is None:
            return None
        return f"srun exited ({code}) saying:\n{self._srun_says() or '(nothing)'}"

    def end(self, lost: bool = False) -> None:
        srun = getattr(self, "srun", None)
        if srun is None:
            return
        try:
            # a lost node's task never exits on its own: srun is ended at once then
            srun.wait(timeout=1.0 if lost else SRUN_EXIT_S)
            return
        except subprocess.TimeoutExpired:
            if not lost:
                logger.warning("clorch_repl: srun did not exit %.0f s after its ranks were told to; terminating it",
                               SRUN_EXIT_S)
        srun.send_signal(signal.SIGTERM)
        try:
            srun.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("clorch_repl: srun ignored SIGTERM; killing it and cancelling its step")
            srun.kill()
            srun.wait()
            self._scancel()

    def _scancel(self) -> None:
        """The backstop after a killed srun: cancel the job by its name (clorch-SESSION)."""
        exe = shutil.which("scancel")
        if exe is None:
            return
        try:
            subprocess.run([exe, f"--name=clorch-{self.server.info.session}"], timeout=10, check=False,
                           capture_output=True)
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("clorch_repl: scancel failed (%s); check squeue for a clorch-%s job",
                           exc, self.server.info.session)
