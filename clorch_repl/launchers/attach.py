"""The ``attach`` launcher: the user starts the ranks with the cluster's own launcher.

``%clorch start --launcher attach --nodes N --nproc-per-node P`` prints one command to run on every
node (torchrun, or srun, or anything that sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``) and waits
with a progress line until all ``N x P`` ranks have called back. The command never holds a secret:
the connect file's path travels in ``CLORCH_CONNECT_FILE``; the file (0600) holds the address,
the notebook's public key and the session's token. It must be readable on the nodes: a shared home
directory, or copied there with its mode kept.

torchrun is given ``--max-restarts 0``: an elastic restart would silently replace a rank (and its
state) behind the notebook's back; ``%clorch restart`` is the way to fresh ranks.
"""

from __future__ import annotations

import logging
import shlex

from .base import Progress
from ..placement.srun import srun_hint
from ..wire.connect import CONNECT_FILE_ENV
from .remote import RemoteLauncher

logger = logging.getLogger(__name__)

#: torchrun's own rendezvous port on the first node (its store; never the process group's).
TORCHRUN_RDZV_PORT = 29400


class AttachLauncher(RemoteLauncher):
    """Ranks started by the user's launcher, calling back (see the module docstring)."""

    name = "attach"

    def torchrun_command(self, first_node: str = "FIRST_NODE") -> str:
        opts = self.options
        return (f"{CONNECT_FILE_ENV}={shlex.quote(self.connect_file)} torchrun --nnodes {opts.nodes} "
                f"--nproc-per-node {opts.nproc_per_node} --max-restarts 0 --rdzv-backend c10d "
                f"--rdzv-endpoint {first_node}:{TORCHRUN_RDZV_PORT} --rdzv-id clorch-{self.server.info.session} "
                f"-m clorch_repl.rank")

    def srun_command(self) -> str:
        opts = self.options
        assert opts.nproc_per_node is not None  # RemoteLauncher refuses a start without it
        return f"{CONNECT_FILE_ENV}={shlex.quote(self.connect_file)} {srun_hint(opts.nodes, opts.nproc_per_node)}"

    def begin(self, progress: Progress) -> None:
        print(f"clorch: run this on each of the {self.options.nodes} node(s) (FIRST_NODE: a host name of the "
              f"first node, the same on all):\n  {self.torchrun_command()}\n"
              f"or, under Slurm, once:\n  {self.srun_command()}\n"
              f"The nodes must read {self.connect_file} (0600; a shared filesystem, or copy it keeping its "
              f"mode) and reach {self.server.info.address}:{self.server.info.port} (TCP).", flush=True)
