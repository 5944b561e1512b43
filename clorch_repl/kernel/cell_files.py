"""The folder a rank's cells are named in: one per user, the same on every rank, instead of
ipykernel's one per process.

ipykernel names a cell's code after a hash of its text, in ``<tmp>/ipykernel_<pid>/``
(``ipykernel.compiler.get_file_name``). IPython's tracebacks turn that name back into ``Cell
In[n]``, but everything else that names a line shows the file: a warning (``/tmp/ipykernel_22483/
2255580287.py:2: UserWarning: careful``), logging's ``%(pathname)s``, ``inspect``. Each rank is a
process of its own, so the same cell's warning read differently on every rank, and the notebook,
which shows what every rank wrote alike once, showed it once per rank. Here every rank of the
user's names its cells in ``<tmp>/clorch_cells_<uid>/`` (:func:`shared_path`): the same cell is
the same file on every rank of a host (and of hosts with the same temporary folder), whichever
session runs it. The name is the text's hash, so a file there only ever holds that text.

The folder is private: made with mode 0700, and used only while it is a real folder (not a link)
of this user's that nobody else may enter; otherwise the rank keeps ipykernel's folder of its own
and its log says why (its warnings then name its own folder again, and are not merged). Nothing is
written there but by ipykernel's debugger, which writes a cell's source for the front end's
breakpoints (``dumpCell``); ranks of several sessions may write the same cell's file at once
(``%clorch debugger`` in two notebooks of the user's), so :class:`RankDebugger` writes it beside
and renames it over: a reader sees the whole text, never half of it.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

from ipykernel import compiler, debugger
from ipykernel.debugger import Debugger

from ..common.atomic import write_atomically

logger = logging.getLogger(__name__)

#: the shared folder's name, under the temporary folder, before the user's uid (the notebook does
#: not read it: it knows a cell's file by the hash in its name, :mod:`clorch_repl.session.cell_files`)
CELL_DIR_PREFIX = "clorch_cells_"

#: ipykernel's own, per process: where a rank names its cells when the shared folder is not safe
_IPYKERNELS = compiler.get_tmp_directory
_lock = threading.Lock()
#: the shared folder once checked: its path, or "" when it is not usable
_shared: str | None = None


def cell_directory() -> str:
    """The folder this rank names its cells in (ipykernel calls it for every cell it compiles):
    the user's shared one, checked once per process, or ipykernel's own when that is not safe."""
    global _shared
    if _shared is None:
        with _lock:
            if _shared is None:
                _shared = _private_folder(shared_path()) or ""
    return _shared or _IPYKERNELS()


def shared_path() -> str:
    """``<tmp>/clorch_cells_<uid>``: the same for every rank of this user on this host."""
    return os.path.join(tempfile.gettempdir(), f"{CELL_DIR_PREFIX}{os.getuid()}")


def _private_folder(path: str) -> str | None:
    """``path``, made (0700) unless there; None, saying why in the rank's log, when it is not a
    folder of this user's that nobody else may enter (a link, another user's, open to others):
    its cell files would then be another user's to read or to replace."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        logger.warning("cannot make %s (%s): this rank names its cells in ipykernel's folder of its own, "
                       "so a warning from a cell shows its own path on each rank and is not merged", path, exc)
        return None
    try:
        found = os.lstat(path)
    except OSError as exc:
        logger.warning("cannot read %s (%s): this rank names its cells in ipykernel's folder of its own", path, exc)
        return None
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        what = ("not a folder" if not stat.S_ISDIR(found.st_mode) else
                f"owned by uid {found.st_uid}" if found.st_uid != os.getuid() else
                f"open to others (mode {stat.S_IMODE(found.st_mode):o})")
        logger.warning("%s is %s, not a private folder of this user's: this rank names its cells in ipykernel's "
                       "folder of its own instead (a warning from a cell then shows its own path on each rank and "
                       "is not merged); remove %s, or make it yours with mode 0700, and restart the ranks",
                       path, what, path)
        return None
    return path


def share_cell_files() -> None:
    """Have ipykernel name every cell in :func:`cell_directory`: its compiler's ``get_file_name``
    looks the folder up at each call, its debugger took the function when it was imported (the
    folder it makes at start and announces in ``debugInfo``)."""
    compiler.get_tmp_directory = cell_directory
    debugger.get_tmp_directory = cell_directory


class RankDebugger(Debugger):
    """ipykernel's debugger, writing a cell's file whole (see the module docstring)."""

    async def dumpCell(self, message: dict[str, Any]) -> dict[str, Any]:  # noqa: N802 - the protocol's name
        """ipykernel's ``dumpCell``: the cell's source at the name its code is compiled under,
        replaced atomically rather than truncated and rewritten in place."""
        code = message["arguments"]["code"]
        file_name = compiler.get_file_name(code)
        write_atomically(file_name, lambda temp, _fd: Path(temp).write_text(code, encoding="utf-8"))
        return {"type": "response", "request_seq": message["seq"], "success": True, "command": message["command"],
                "body": {"sourcePath": file_name}}
