"""The file by which a kernel says it serves requests: the contract between a rank's kernel
(:mod:`clorch_repl.kernel.app` writes it) and the launcher that waits for it
(:mod:`clorch_repl.launchers.local`: a warm spare is "ready" once it is there).

Why not the kernel's bound sockets, which are there earlier: a kernel binds them first and then
builds its IPython shell and runs its start-up code, and on the 16-core GPU host a warm spare
answered its first request 0.35 s after its sockets existed (``benchmarks/restart_phases.py``,
issue 39); a restart that took a spare ready by its sockets waited that out in its connect.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def serving_path(connection_file: str) -> str:
    """The file beside a kernel's connection file that says its event loop runs."""
    return os.path.realpath(connection_file) + ".serving"


def mark_serving(connection_file: str) -> None:
    """Written by the kernel from its event loop's first turn: a request sent from now on is read
    at once. Empty and private to the user; the local launcher removes it when it ends the kernel
    (``LocalLauncher._end``), a nanny with its folder when it exits."""
    try:
        os.close(os.open(serving_path(connection_file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    except OSError as exc:  # its folder is gone (the session ended meanwhile): nobody waits for it
        logger.debug("could not mark the kernel serving: %s", exc)


def is_serving(connection_file: str) -> bool:
    """Whether the kernel of ``connection_file`` has reached its event loop (:func:`mark_serving`)."""
    return os.path.exists(serving_path(connection_file))
