"""A launcher from outside clorch_repl, found the way a plugin's would be: through the
``clorch_repl.launchers`` entry-point group (this folder's ``clorch_procs_launcher-0.1.dist-info``,
put on ``sys.path`` by the test that uses it; nothing is installed).

``procs`` starts each rank's nanny (``python -m clorch_repl.rank``) as a plain child process with
torchrun's rank variables, as a site's own launcher (an SSH fan-out, a scheduler) would on its
nodes, and hands it the callback endpoint in ``CLORCH_CONNECT`` as srun's tasks get it. It is
written only against :class:`clorch_repl.launchers.remote.RemoteLauncher`'s documented hooks
(``begin``, ``still_coming``, ``end``): if the seam needs more than those, this breaks.
"""

from __future__ import annotations

import os
import subprocess
import sys

from clorch_repl.launchers.base import Progress
from clorch_repl.wire.connect import CONNECT_ENV
from clorch_repl.launchers.remote import RemoteLauncher

#: How long the nannies get to exit on their own once told to, before they are terminated.
EXIT_WAIT_S = 10.0


class ProcsLauncher(RemoteLauncher):
    """Every rank's nanny a child of the notebook's process, on this host."""

    name = "procs"

    def begin(self, progress: Progress) -> None:
        opts = self.options
        assert opts.nproc_per_node is not None
        world = opts.nodes * opts.nproc_per_node
        self.nannies = [subprocess.Popen(
            [sys.executable, "-m", "clorch_repl.rank"],
            env=dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % opts.nproc_per_node), WORLD_SIZE=str(world),
                     LOCAL_WORLD_SIZE=str(opts.nproc_per_node), **{CONNECT_ENV: self.server.info.dumps()}),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            for rank in range(world)]
        progress(f"{world} nannies started; waiting for them to call back")

    def still_coming(self) -> str | None:
        ended = [(rank, p.returncode) for rank, p in enumerate(self.nannies) if p.poll() is not None]
        return f"nannies ended before calling back: {ended}" if ended else None

    def end(self, lost: bool = False) -> None:
        for nanny in getattr(self, "nannies", []):
            try:
                nanny.wait(timeout=1.0 if lost else EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                nanny.terminate()
                nanny.wait(timeout=EXIT_WAIT_S)
