"""Files a reader sees whole or not at all: written beside the target, fsynced, renamed over it.

One writer for every file that another process (or a later run) reads while it may be replaced:
a launched rank's result and a job's spec (small JSON, 0600), and checkpoints (``torch.save``,
large, the mode a plain ``open()`` gives). ``os.replace`` is atomic on POSIX, so after a crash the
path holds the old file or the new one, never half of either; the folder is fsynced afterwards so
the rename itself survives a power cut. Standard library only: the notebook side imports it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["write_atomically", "write_json_atomic", "fsync_dir", "remove_quietly"]


def fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (best effort: some filesystems refuse to open folders,
    and the rename is still atomic there)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        logger.debug("cannot open %s to fsync it: %s", folder, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        logger.debug("fsync of the folder %s failed: %s", folder, exc)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Delete ``path`` if it is there; a failure is logged, never raised (this is clean-up)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.debug("could not remove %s: %s", path, exc)


def write_atomically(path: str, write: Callable[[str, int], None], *, mode: int = 0o600,
                     temp_path: str | None = None, before_replace: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with what ``write(temp_path, fd)`` writes, atomically.

    The temporary file is created beside ``path`` (same filesystem, so the rename is atomic) with
    ``O_EXCL`` (never following or reusing another file) and ``mode`` less the umask; ``write``
    may write through the descriptor or reopen the path. It is fsynced, ``before_replace`` runs
    (a caller may keep the previous file alive there), then it is renamed over ``path`` and the
    folder is fsynced. On any failure the temporary file is removed and ``path`` is untouched.
    """
    folder = os.path.dirname(path) or "."
    if temp_path is None:
        temp_path = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        write(temp_path, fd)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if before_replace is not None:
            before_replace()
        os.replace(temp_path, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        remove_quietly(temp_path)
        raise
    fsync_dir(folder)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_json_atomic(path: str, payload: dict[str, Any]) -> None:
    """``payload`` as JSON at ``path`` (0600): a reader never sees half of it."""
    data = json.dumps(payload).encode()
    write_atomically(path, lambda _tmp, fd: _write_all(fd, data))
