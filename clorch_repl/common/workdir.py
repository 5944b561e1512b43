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
import sys

from ..errors import ConfigError

#: what Linux appends to the link of a working directory that was deleted
_DELETED = " (deleted)"


def working_directory(needed: str = "new ranks start in it") -> str:
    """This process's working directory. Where it was deleted under a running notebook, a
    :class:`~clorch_repl.errors.ConfigError` naming it, saying why it was ``needed`` and what to do."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        where = f"(pid {os.getpid()} on host {socket.gethostname()})"
        path = _gone_path()
        if not path:
            said = f"this process's working directory {where} was deleted"
        elif os.path.isdir(path):  # made again at its path: another folder, which this process is not in
            said = f"this process's working directory, {path} {where}, was deleted; the folder there now is another one"
        else:
            said = f"this process's working directory, {path} {where}, was deleted"
        raise ConfigError(f"{said}, and {needed}: change to an existing folder (%cd in a notebook, "
                          "os.chdir() in a script) and try again") from None


def torch_importable(what: str) -> None:
    """Refuse ``what``, a command that imports torch in this process, where torch is not imported
    yet and the working directory was deleted: torch's import then ends the process (Intel oneMKL's
    "Cannot load libtorch_cpu.so", exit status 2), and a notebook kernel's end ends its ranks."""
    if torch_import_refused():
        working_directory(f"{what} imports torch here, which would end this process in a deleted folder")


def torch_import_refused() -> bool:
    """Whether :func:`torch_importable` would refuse now (asked where a refusal must come later, in
    the words of whoever refuses)."""
    if "torch" in sys.modules:
        return False
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def _gone_path() -> str:
    """The deleted folder's last path, as Linux keeps it ("" where it cannot say)."""
    try:
        return os.readlink("/proc/self/cwd").removesuffix(_DELETED)
    except OSError:
        return ""


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
