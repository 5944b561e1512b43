"""The working directory that new ranks start in, and what to say when it was deleted.

A notebook's folder can be removed under a running kernel (a temporary folder cleaned up, a
checkout moved). ``os.getcwd`` then raises a bare FileNotFoundError, which used to surface from
deep in a launcher naming neither the folder nor a remedy. Every start of ranks (cold, from warm
spares, remote, batch jobs) asks here instead.
"""

from __future__ import annotations

import os
import socket

from ..errors import ConfigError


def working_directory() -> str:
    """This process's working directory, which new ranks start in. Where it was deleted (or moved
    away) under a running notebook, a :class:`~clorch_repl.errors.ConfigError` saying so and what
    to do: ``os.getcwd``'s bare FileNotFoundError named neither the folder nor a remedy."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise ConfigError(f"the working directory of this process (pid {os.getpid()} on host {socket.gethostname()}) "
                          "no longer exists: it was deleted or moved away, and new ranks start in it. Change "
                          "to an existing folder (%cd in a notebook, os.chdir() in a script) and try again") from None


def still_in(folder: str) -> bool:
    """Whether this process's working directory is still ``folder`` (False once it is gone)."""
    try:
        return os.getcwd() == folder
    except FileNotFoundError:
        return False
