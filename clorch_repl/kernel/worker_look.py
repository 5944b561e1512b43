"""A rank looks to libraries as torchrun's worker does: not an interactive interpreter.

Libraries decide how to start and talk to processes by asking whether Python runs interactively:
``hasattr(sys, "ps1")`` or ``sys.flags.interactive`` (Lightning's ``_IS_INTERACTIVE``, which makes
Fabric and Trainer refuse ``strategy="ddp"`` and ``"fsdp"`` with "not compatible with an interactive
environment"), or ``hasattr(__main__, "__file__")``. A rank is a Jupyter kernel, and IPython's
shell sets ``sys.ps1``/``ps2``/``ps3`` at start "so that scripts can decide if they are running
interactively" (``InteractiveShell.init_prompts``); but a rank is one of the world's processes,
already in its group, as torchrun's worker is, and the question those libraries ask (may I start
processes of my own, or must I run inside this one?) has the worker's answer.

What else reads the prompts: nothing of IPython's or ipykernel's (IPython only sets them, and its
terminal ``embed`` saves and restores them); debugpy's console sets its own when they are missing.
So a rank deletes them once its shell exists (:func:`look_like_a_worker`). ``sys.flags.interactive``
is already 0 (a rank is ``python -m``, without ``-i``). ``__main__`` is left as IPython made it,
without ``__file__``: ``%clorch run`` gives a script a ``__main__`` module with the script's file,
as torchrun's worker has; a cell has no file, and a made-up one would send
``multiprocessing``'s spawn start method (DataLoader workers) looking for it.

``sys.argv`` loses the kernel's own arguments (``-f CONNECTION_FILE`` and the like), which ipykernel
has read by then: a worker's argv is its script's command line, and a torchrun script pasted into
a cell calls ``parser.parse_args()``, which read the connection file's path as its first argument
("invalid int value: '/tmp/clorch-.../rank0.json'"). With ``[argv[0]]`` it sees no arguments, as a
script run without any: its defaults, or argparse's own "the following arguments are required".
``%clorch run`` sets a script's argv for its run and puts this one back.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

#: what IPython's shell sets (InteractiveShell.init_prompts)
PROMPTS = ("ps1", "ps2", "ps3")


def look_like_a_worker() -> None:
    """Remove the interactive prompts IPython set, and the kernel's own arguments from
    ``sys.argv`` (see the module docstring); idempotent."""
    for name in PROMPTS:
        if hasattr(sys, name):
            delattr(sys, name)
    del sys.argv[1:]
    logger.debug("sys.ps1/ps2/ps3 removed: the rank answers 'not interactive', as torchrun's worker does")
