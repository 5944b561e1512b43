"""Replacing a checkpoint folder in one step: written beside it, swapped in by one rename.

A sharded save writes into ``.<name>.clorch-saving.<host>.<pid>.<random>`` beside the target (the
same filesystem, so a rename is atomic), every rank its own files. Only when every rank's files
are durable and rank zero has seen all of them does rank zero commit (:func:`commit`):

* no previous checkpoint: ``rename(temp, target)``;
* a previous one (a folder, or a single-file checkpoint): Linux's ``renameat2(RENAME_EXCHANGE)``
  swaps the two paths atomically, so ``target`` names the whole old checkpoint until the instant it
  names the whole new one; the old one, now at the temporary name, is deleted afterwards.

POSIX ``rename`` cannot replace a non-empty folder, so without ``RENAME_EXCHANGE`` (another kernel,
a filesystem that refuses it) the old checkpoint is first renamed aside and the new one renamed in:
a crash between the two renames leaves ``target`` missing and the previous checkpoint whole under
its temporary name, which the load error then names. A warning says so once.

Whatever a killed save leaves (its temporary folder, an old checkpoint not yet deleted) carries
its host and pid in its name; :func:`remove_leftovers` deletes those of this host whose process
is gone, before the next save starts.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import secrets
import shutil
import socket
import threading

from ...common.atomic import fsync_dir, remove_quietly
from ...errors import CheckpointError, ConfigError
from ...common.procs import pid_running
from .safe_dcp import METADATA_FILE

logger = logging.getLogger(__name__)

__all__ = ["temp_folder", "remove_leftovers", "check_replaceable", "commit", "leftover_of", "missing_files"]

_MARK = ".clorch-saving."
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_warned_no_exchange = False


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def temp_name(target: str) -> str:
    """A fresh name beside ``target`` that carries this host and pid (see :func:`remove_leftovers`)."""
    folder, base = os.path.split(target)
    return os.path.join(folder, f".{base}{_MARK}{_host()}.{os.getpid()}.{secrets.token_hex(4)}")


def temp_folder(target: str) -> str:
    """A new, empty temporary folder beside ``target`` (created here, mode 0777 less the umask)."""
    path = temp_name(target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.mkdir(path)
    return path


def _owner(name: str, base: str) -> tuple[str, int] | None:
    prefix = f".{base}{_MARK}"
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix):].rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def remove_leftovers(target: str) -> None:
    """Delete what earlier saves to ``target`` left behind whose writer on this host is gone."""
    folder, base = os.path.split(target)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        owner = _owner(name, base)
        if owner is None or owner[0] != _host() or (owner[1] != os.getpid() and pid_running(owner[1])):
            continue
        logger.debug("removing %s, left in %s by a save that did not finish (pid %d)", name, folder, owner[1])
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def leftover_of(target: str) -> str | None:
    """A complete checkpoint left beside a missing ``target`` by a commit cut between its renames."""
    folder, base = os.path.split(target)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        path = os.path.join(folder, name)
        if _owner(name, base) is not None and os.path.isfile(os.path.join(path, METADATA_FILE)):
            return path
    return None


def check_replaceable(target: str, is_checkpoint_file: bool) -> None:
    """ConfigError unless ``target`` is absent, an empty folder or a checkpoint: a save must never
    delete a folder of other files (a data set given as the path by mistake)."""
    if not os.path.lexists(target):
        return
    if os.path.islink(target):
        raise ConfigError(f"{target} is a symbolic link; give the real path of the checkpoint folder")
    if os.path.isdir(target):
        if os.path.isfile(os.path.join(target, METADATA_FILE)) or not os.listdir(target):
            return
        raise ConfigError(f"{target} is a folder that holds no checkpoint (no {METADATA_FILE}); saving there "
                          "would delete its files: choose another path")
    if not is_checkpoint_file:
        raise ConfigError(f"{target} exists and is not a checkpoint; saving there would delete it: "
                          "choose another path")


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the kernel or filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2 of {a} and {b}: {os.strerror(code)}")


def commit(temp: str, target: str) -> None:
    """Put the finished checkpoint folder ``temp`` at ``target`` in one step (see the module's
    docstring); the previous checkpoint is deleted afterwards. Rank zero only."""
    global _warned_no_exchange
    folder = os.path.dirname(target)
    fsync_dir(temp)
    if not os.path.lexists(target):
        os.rename(temp, target)
        fsync_dir(folder)
        return
    if os.path.isdir(target) and not os.listdir(target):
        os.rmdir(target)
        os.rename(temp, target)
        fsync_dir(folder)
        return
    if not _exchange(temp, target):
        if not _warned_no_exchange:
            logger.warning("this filesystem cannot swap two paths atomically (renameat2): a crash between "
                           "moving the old checkpoint aside and the new one in leaves %s missing, the old one "
                           "beside it", target)
            _warned_no_exchange = True
        aside = temp_name(target)  # a leftover's name: the next save removes it if this one dies
        os.rename(target, aside)
        try:
            os.rename(temp, target)
        except OSError:
            os.rename(aside, target)  # the previous checkpoint back where it was
            raise
        temp = aside
    fsync_dir(folder)
    # Freeing a large checkpoint's blocks takes about as long as writing a good part of it and is
    # not needed for the new one to be durable: it runs on a thread; a killed process leaves it to
    # the next save's remove_leftovers (the name carries this host and pid).
    old = temp
    thread = threading.Thread(target=_remove, args=(old,), name="clorch-checkpoint-unlink", daemon=True)
    thread.start()
    _DELETING.append(thread)


_DELETING: list[threading.Thread] = []


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        remove_quietly(path)


def _finish_deleting() -> None:
    while _DELETING:
        _DELETING.pop().join()


atexit.register(_finish_deleting)


def missing_files(folder: str, metadata: object) -> list[str]:
    """Files the metadata names that rank zero does not see whole in ``folder`` (a folder not
    shared by every rank's host, a write that did not land)."""
    wanted: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        wanted[rel] = max(wanted.get(rel, 0), end)
    missing = []
    for rel, size in sorted(wanted.items()):
        if os.path.isabs(rel) or ".." in rel.split(os.sep):
            raise CheckpointError(f"the checkpoint {folder} names a file outside its folder ({rel!r}); "
                                  "it is not a checkpoint written by save_checkpoint")
        try:
            if os.path.getsize(os.path.join(folder, rel)) < size:
                missing.append(f"{rel} (truncated)")
        except OSError:
            missing.append(rel)
    return missing
