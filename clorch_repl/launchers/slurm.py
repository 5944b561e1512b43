"""The ``slurm`` launcher: ``srun`` starts ``python -m clorch_repl.rank`` on the nodes.

Inside an allocation (``salloc``, an ``sbatch`` job: ``SLURM_JOB_ID`` is set) srun runs a step in
it; outside, srun asks Slurm for one (``--partition``, ``--time``). The nannies never exit because
a kernel died, so the step (and the allocation) lives until ``%clorch stop``: then every nanny is
told to exit, srun sees its tasks end and exits, and only if it does not within
:data:`SRUN_EXIT_S` is it sent SIGTERM (srun then ends the step itself), then, after
:data:`~clorch_repl.placement.srun.SRUN_KILL_WAIT_S`, SIGKILL and ``scancel``.
The srun command line, the step's process and its end are :mod:`clorch_repl.placement.srun`'s,
shared with batch jobs (``launch(launcher="slurm")``).

The nodes run the notebook's own Python (``sys.executable``): on a cluster that is a shared
filesystem's virtual environment, as for any srun of a Python program. The connect info reaches the
tasks in their environment (``CLORCH_CONNECT``; srun passes the notebook's environment on), so no
file has to be shared for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

from .base import Progress
from ..placement.srun import SRUN_KILL_WAIT_S, SrunStep, srun_command
from ..wire.connect import CONNECT_ENV, CONNECT_FILE_ENV, route_address
from .callback import default_listen_address
from .remote import RemoteLauncher

logger = logging.getLogger(__name__)

#: How long srun gets to exit on its own after the nannies were told to exit.
SRUN_EXIT_S = 10.0


def first_node_address() -> str | None:
    """A node's address from ``scontrol show nodes`` (NodeAddr), None when there is none to be
    had: the notebook listens on the interface that routes to it (only a session's ranks call
    back to the notebook; a batch job's meet through files, so this is the launcher's alone)."""
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


class SlurmLauncher(RemoteLauncher):
    """Ranks as the tasks of one srun step (see the module docstring)."""

    name = "slurm"
    batch_ranks = "clorch_repl.jobs.job_ranks:SlurmJobRanks"

    def default_listen(self) -> str:
        node = first_node_address()
        if node:
            try:
                return route_address(node)
            except OSError as exc:
                logger.info("no route to node address %s: %s", node, exc)
        return default_listen_address()

    @property
    def job_name(self) -> str:
        """The step's ``--job-name``, by which ``scancel`` finds it."""
        return f"clorch-{self.server.info.session}"

    def command(self) -> list[str]:
        opts = self.options
        assert opts.nproc_per_node is not None
        return srun_command(opts.nodes, opts.nproc_per_node, self.job_name, partition=opts.partition,
                            time=opts.time, srun_args=opts.srun_args) + [sys.executable, "-m", "clorch_repl.rank"]

    def begin(self, progress: Progress) -> None:
        # srun hands every task this environment: the nodes need no shared filesystem for it
        env = dict(os.environ, **{CONNECT_ENV: self.server.info.dumps(), CONNECT_FILE_ENV: self.connect_file})
        self.srun = SrunStep.start(self.command(), env=env, log_path=os.path.join(self.dir, "srun.log"),
                                   name=self.job_name, what=f"session {self.server.info.session}")
        progress(f"srun started ({self.options.nodes} node(s) x {self.options.nproc_per_node}); waiting for the "
                 "ranks to call back")

    def still_coming(self) -> str | None:
        code = self.srun.poll()
        if code is None:
            return None
        return f"srun exited ({code}) saying:\n{self.srun.said() or '(nothing)'}"

    def end(self, lost: bool = False) -> None:
        srun = getattr(self, "srun", None)
        if srun is None:
            return
        # a lost node's task never exits on its own: srun is ended at once then
        srun.end(exit_wait_s=1.0 if lost else SRUN_EXIT_S, expected_exit=not lost, term_wait_s=SRUN_KILL_WAIT_S)
