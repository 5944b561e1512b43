"""The working directory that new ranks start in, and what to say when it was deleted.

A notebook's folder can be removed under a running kernel (a temporary folder cleaned up, a
checkout deleted and cloned again). ``os.getcwd`` then raises a bare FileNotFoundError, which used
to surface from deep in a launcher naming neither the folder nor a remedy. Every start of ranks
(cold, from warm spares, remote, batch jobs) asks here first, before it ends or starts anything.

A folder made again at the same path is another folder: a process started in the first one still
works in the deleted one (its relative paths fail there). Warm spares and the zygote that forks
ranks are therefore judged by the folder itself (:func:`shares_folder`), not by its path.
"""

from __future__ import annotations

import os
import socket

from ..errors import ConfigError

#: what Linux appends to the link of a working directory that was deleted
_DELETED = " (deleted)"


def working_directory() -> str:
    """This process's working directory, which new ranks start in. Where it was deleted under a
    running notebook, a :class:`~clorch_repl.errors.ConfigError` naming it and saying what to do."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise ConfigError(f"the working directory of this process{_gone_name()} (pid {os.getpid()} on host "
                          f"{socket.gethostname()}) no longer exists, and new ranks start in it: change to an "
                          "existing folder (%cd in a notebook, os.chdir() in a script) and try again") from None


def _gone_name() -> str:
    """`` ``PATH``: the deleted folder's last path, as Linux keeps it (empty where it cannot say)."""
    try:
        link = os.readlink("/proc/self/cwd")
    except OSError:
        return ""
    return f", {link.removesuffix(_DELETED)},"


def shares_folder(pid: int | None, folder: str) -> bool:
    """Whether process ``pid`` (started in ``folder``) still works in the very folder this process
    works in: False once this process's folder is gone, or when it is another folder, even at the
    same path. Where the process's own link cannot be read (no /proc, the process gone), the paths
    are compared."""
    try:
        here = os.getcwd()
    except FileNotFoundError:
        return False
    if pid is not None:
        try:
            return os.path.samestat(os.stat(here), os.stat(f"/proc/{pid}/cwd"))
        except OSError:
            pass
    return here == folder
