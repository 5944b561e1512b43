"""Rank logs outlive their session, and are shown as text.

A session's files live in one private directory (0700: connection files with the kernels' keys,
IPC sockets, the rendezvous store, stack dumps, pid files, the rank logs) that is removed when the
session stops, when the notebook kernel dies (each rank's supervisor, :mod:`.supervisor`) and, on
another host, when the rank's nanny ends. The logs are what one wants to read after a crash, so
:func:`keep_logs` moves them (``rankN.log`` and its older half ``rankN.log.1``, :mod:`.logcap`)
out first, into ``<session directory>-logs`` beside it (also 0700, this user's), and nothing else:
the keys, sockets and store go with the directory. The name is derived from the session's
directory so that the supervisors of several ranks, ending at once, put every rank's log into one
folder.

``CLORCH_KEEP_LOGS=0`` in the notebook kernel's environment (each rank's supervisor inherits it;
a remote rank's nanny reads its own) removes the logs with the rest, as before; a test suite
that starts hundreds of sessions sets it.

A rank's log holds what its process wrote, colour codes included (IPython's tracebacks); those
are for a terminal, and :func:`without_ansi` takes them out where a log is shown as text
(``%clorch logs``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

try:
    from ..common import env_vars
except ImportError:  # imported by the supervisor run as a script (python -I -S), which puts common/ on sys.path
    import env_vars  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

#: "0" removes the rank logs with their session's files (the default, "1", keeps them)
KEEP_ENV = env_vars.KEEP_LOGS.name
_LOG_NAME = re.compile(r"rank\d+\.log(\.1)?")
#: CSI sequences (colours, cursor moves) and OSC sequences (titles, links), as terminals read them
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def keep_logs(session_dir: str) -> str:
    """Move the rank logs of ``session_dir`` into ``<session_dir>-logs``; returns that folder, or
    "" when there was no log to keep (or :data:`KEEP_ENV` is "0"). Safe to call from several
    processes at once."""
    if (env_vars.KEEP_LOGS.get() or "").strip() == "0":
        return ""
    try:
        names = sorted(n for n in os.listdir(session_dir) if _LOG_NAME.fullmatch(n))
    except OSError as exc:  # gone already (another rank's supervisor removed it)
        logger.debug("no rank logs to keep in %s: %s", session_dir, exc)
        return ""
    if not names:
        return ""
    kept = _private_folder(session_dir.rstrip(os.sep) + "-logs")
    for name in names:
        try:
            os.replace(os.path.join(session_dir, name), os.path.join(kept, name))
        except FileNotFoundError:  # another process moved it first
            continue
        except OSError as exc:
            logger.warning("clorch_repl: could not keep the rank log %s (%s); it is removed with its session",
                           name, exc)
    return kept


def remove_keeping_logs(session_dir: str) -> str:
    """Remove ``session_dir`` and everything in it but its rank logs (:func:`keep_logs`); returns
    where those are ("" when none were kept)."""
    kept = keep_logs(session_dir)
    shutil.rmtree(session_dir, ignore_errors=True)
    return kept


def kept_log(folder: str, rank: int, lines: int | None) -> tuple[str, str]:
    """The path and last ``lines`` lines (None: all) of ``rank``'s log in ``folder``, where
    :func:`keep_logs` kept a stopped session's logs (``%clorch logs N`` once no ranks run);
    FileNotFoundError, naming the folder and the logs it has, when it holds none of that rank."""
    from .rankfiles import log_tail  # (the notebook's: never called where this runs as a script)

    path = os.path.join(folder, f"rank{rank}.log")
    if not os.path.isfile(path):
        try:
            there = sorted(n for n in os.listdir(folder) if _LOG_NAME.fullmatch(n) and not n.endswith(".1"))
        except OSError:
            there = []
        raise FileNotFoundError(f"{folder} holds no log of rank {rank}"
                                + (f" (it has {', '.join(there)})" if there else " (it is gone or empty)"))
    return path, log_tail(path, lines)


def _private_folder(path: str) -> str:
    """``path`` as a folder only this user can open; another private folder beside it when
    ``path`` exists and is not one (someone else's, or a link)."""
    try:
        os.mkdir(path, 0o700)
        return path
    except FileExistsError:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return path
    logger.warning("clorch_repl: %s exists and is not this user's private folder; the logs go elsewhere", path)
    return tempfile.mkdtemp(prefix=os.path.basename(path) + "-", dir=os.path.dirname(path))


def without_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colour codes)."""
    return _ANSI.sub("", text)
