"""``python -m clorch_repl.rank`` (also ``clorch-rank``): a rank's nanny, run on a node by srun,
torchrun or any launcher that sets the rank variables. The nanny lives in
:mod:`clorch_repl.host.nanny`; this name stays because it is the command users, their
launchers and the commands ``--launcher attach`` prints run."""

from __future__ import annotations

import sys

from .host.nanny import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
