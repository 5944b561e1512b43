"""The clorch checkpoint file: a ``torch.save`` zip that a crash never leaves half-written and that
loads without unpickling code.

It is the whole checkpoint of an unsharded model (:mod:`.single_file`) and, inside a sharded
checkpoint's folder, the ``clorch.pt`` that holds what DCP's files do not: every rank's RNG and
sampler state, the scaler state and the JSON metadata (:mod:`.sharded`).

Writing: ``.<name>.clorch-tmp.<pid>.<random>`` in the same folder, fsynced, ``os.replace``d over
the target (atomic on POSIX) and the folder fsynced (:func:`clorch_repl.common.atomic.write_atomically`),
so after a crash the path holds either the previous file or the new one. Temporary files left by a
killed writer are removed by the next save. The file gets the mode a plain ``open()`` would give it
(0666 less the umask), like ``torch.save``.

Reading: the zip container's CRCs are verified first (``torch.load`` does not check them, so a
flipped byte in the weights would otherwise load silently), then ``torch.load(weights_only=True)``
reads it (no pickled code runs: RNG states are tensors and metadata is a JSON string); a file that
is not a clorch checkpoint, or of another format version, raises CheckpointError.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import threading
import zipfile
from typing import Any

import torch

from ...common.atomic import remove_quietly, write_atomically
from ...common.procs import pid_running
from ...errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["FORMAT", "FORMAT_VERSION", "write_container", "read_container", "is_torch_file"]

FORMAT = "clorch-checkpoint"
FORMAT_VERSION = 1
_TMP_MARK = ".clorch-tmp."


def is_torch_file(path: str) -> bool:
    """Whether ``path`` is a file in torch.save's zip format (what a save may replace)."""
    return os.path.isfile(path) and zipfile.is_zipfile(path)


def _remove_stale_temps(folder: str, base: str) -> None:
    """Delete temporary files of earlier saves whose writer is gone (killed mid-write)."""
    prefix = f".{base}{_TMP_MARK}"
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split(".", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() and name.endswith(".old") and _PENDING_UNLINKS:
            continue  # this process is deleting it right now
        if pid != os.getpid() and pid_running(pid):
            continue
        logger.debug("removing %s, left in %s by a save that did not finish (pid %d)", name, folder, pid)
        remove_quietly(os.path.join(folder, name))


_PENDING_UNLINKS: list[threading.Thread] = []


def _join_pending_unlinks() -> None:
    while _PENDING_UNLINKS:
        _PENDING_UNLINKS.pop().join()


atexit.register(_join_pending_unlinks)


def _sync_while_writing(fd: int, done: threading.Event, errors: list[OSError]) -> None:
    """Push what torch.save has written so far to disk while it keeps writing, so the fsync that
    durability needs at the end waits only for the tail, not for the whole file."""
    sync = getattr(os, "fdatasync", os.fsync)
    while not done.wait(0.01):
        try:
            sync(fd)
        except OSError as exc:  # the final fsync reports it
            errors.append(exc)
            return


def write_container(path: str, payload: dict[str, Any]) -> None:
    """``torch.save`` through :func:`~clorch_repl.common.atomic.write_atomically`.

    The previous checkpoint's inode is kept alive by a hard link until the rename is done and then
    deleted in the background: freeing a large file's blocks takes as long as writing a good part
    of it, and it is not needed for the new file to be durable. Whatever a killed process leaves
    behind carries its pid in the name and is removed by the next save.
    """
    folder, base = os.path.split(path)
    folder = folder or "."
    os.makedirs(folder, exist_ok=True)
    _PENDING_UNLINKS[:] = [t for t in _PENDING_UNLINKS if t.is_alive()]
    _remove_stale_temps(folder, base)
    stem = os.path.join(folder, f".{base}{_TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")
    old = stem + ".old"
    kept_old = False

    def save(tmp: str, fd: int) -> None:
        done, errors = threading.Event(), []
        syncer = threading.Thread(target=_sync_while_writing, args=(fd, done, errors), daemon=True,
                                  name="clorch-checkpoint-sync")
        syncer.start()
        try:
            torch.save(payload, tmp)  # by path: torch's own buffered writer, the fastest route
        finally:
            done.set()
            syncer.join()

    def keep_old() -> None:
        nonlocal kept_old
        try:
            os.link(path, old)
            kept_old = True
        except OSError:  # no previous checkpoint, or a filesystem without hard links
            pass

    try:
        # 0o666 so the umask decides, as with open() and torch.save
        write_atomically(path, save, mode=0o666, temp_path=stem + ".new", before_replace=keep_old)
    except BaseException:
        if kept_old:
            remove_quietly(old)
        raise
    if kept_old:
        thread = threading.Thread(target=remove_quietly, args=(old,), name="clorch-checkpoint-unlink")
        thread.start()
        _PENDING_UNLINKS.append(thread)


def read_container(path: str, device: torch.device) -> dict[str, Any]:
    """Open, verify and unpickle (weights only) one checkpoint file; raise CheckpointError on anything odd."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: check the path, or save one first")
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder, not a checkpoint file")
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {path}: {exc}") from None
    # One open file for both passes: a save replacing the path meanwhile cannot mix two files.
    with handle:
        try:
            with zipfile.ZipFile(handle) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint {path} is truncated or not a checkpoint file ({exc}); "
                                  "it cannot be loaded: use an earlier checkpoint") from None
        if bad is not None:
            raise CheckpointError(f"the checkpoint {path} is corrupt (record {bad!r} fails its checksum); "
                                  "it cannot be loaded: use an earlier checkpoint")
        handle.seek(0)
        try:
            payload = torch.load(handle, map_location=device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised as a CheckpointError, its stack logged here
            logger.debug("torch.load of the checkpoint %s failed", path, exc_info=True)
            message = str(exc)
            text = message.splitlines()[0] if message else type(exc).__name__
            if "weights_only" in message or "Unpickl" in type(exc).__name__:
                raise CheckpointError(f"refused to load {path}: it contains Python objects other than "
                                      f"tensors and plain data, and loading them could run code ({text}). "
                                      "Only load checkpoints written by save_checkpoint") from None
            raise CheckpointError(f"the checkpoint {path} could not be read ({type(exc).__name__}: "
                                  f"{text}); use an earlier checkpoint") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is a torch file but not a clorch_repl checkpoint (written by "
                              "save_checkpoint); load it with torch.load yourself")
    if payload.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is a version {payload.get('version')} checkpoint; this clorch_repl "
                              f"reads version {FORMAT_VERSION}: upgrade clorch_repl")
    try:
        payload["metadata"] = json.loads(payload["metadata"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"the checkpoint {path} has unreadable metadata; use an earlier checkpoint") from None
    return payload


