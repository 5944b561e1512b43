"""A rank names its cells in one folder of the user's (clorch_repl.kernel.cell_files), so that the
same cell is the same file on every rank (a warning from it then reads the same, and merges): the
folder is used only while it is private, and the debugger's writes of a cell's file, which several
ranks may make at once, are never seen half done.

On real ranks (the warning merged, the folder's mode, tracebacks still ``Cell In[n]``):
tests/integration/test_merge_output_live.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
from ipykernel import compiler

from clorch_repl.kernel import cell_files


def use_folder(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """The rank's check (once per process) made again, on ``path``, and ipykernel naming cells by it."""
    monkeypatch.setattr(cell_files, "shared_path", lambda: str(path))
    monkeypatch.setattr(cell_files, "_shared", None)
    monkeypatch.setattr(compiler, "get_tmp_directory", cell_files.cell_directory)  # as share_cell_files does


def test_a_cell_is_named_in_the_users_folder_made_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # every rank of the user's on this host: the same folder, whatever its pid
    assert cell_files.shared_path() == os.path.join(tempfile.gettempdir(), f"clorch_cells_{os.getuid()}")
    folder = tmp_path / f"clorch_cells_{os.getuid()}"
    use_folder(monkeypatch, folder)
    name = compiler.get_file_name("import warnings\nwarnings.warn('careful')\n")
    assert os.path.dirname(name) == str(folder) and f"ipykernel_{os.getpid()}" not in name
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def _link(folder: Path) -> None:
    target = folder.with_name("elsewhere")
    target.mkdir(mode=0o700)
    folder.symlink_to(target)


def _open_to_others(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o755)


def _a_file(folder: Path) -> None:
    folder.write_text("not a folder")


@pytest.mark.parametrize("make, said", [(_link, "is not a folder"), (_a_file, "is not a folder"),
                                        (_open_to_others, "is open to others (mode 755)")])
def test_a_folder_that_is_not_private_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture, make: Callable[[Path], None],
                                                  said: str) -> None:
    folder = tmp_path / "cells"
    make(folder)
    use_folder(monkeypatch, folder)
    with caplog.at_level(logging.WARNING, logger=cell_files.__name__):
        name = compiler.get_file_name("x = 1\n")
    assert os.path.dirname(name) == os.path.join(tempfile.gettempdir(), f"ipykernel_{os.getpid()}"), name  # as before
    assert f"{folder} {said}, not a private folder of this user's" in caplog.text, caplog.text
    assert f"remove {folder}, or make it yours with mode 0700, and restart the ranks" in caplog.text


def test_ranks_writing_a_cells_file_at_once_never_show_half_of_it(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    # ipykernel's dumpCell truncates the file and writes it again: a rank's debugger reading it
    # meanwhile (another rank's dump of the same cell) found it empty or cut short.
    use_folder(monkeypatch, tmp_path / "cells")
    code = "total = total + 1\n" * 8_000  # a long cell (144 KB): its write takes several system calls
    path = compiler.get_file_name(code)
    debugger = cell_files.RankDebugger(logging.getLogger(__name__), None, None, None, None, [])
    message: dict[str, Any] = {"seq": 1, "command": "dumpCell", "arguments": {"code": code}}
    writing = threading.Event()
    seen: list[int] = []

    def write() -> None:
        for _ in range(5):
            reply = asyncio.run(debugger.dumpCell(message))
            assert reply["body"]["sourcePath"] == path and reply["success"]

    def read() -> None:
        while writing.is_set():
            try:
                text = Path(path).read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
            if text != code:
                seen.append(len(text))

    writers = [threading.Thread(target=write) for _ in range(3)]
    reader = threading.Thread(target=read)
    writing.set()
    reader.start()
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    writing.clear()
    reader.join()
    assert seen == [], f"read {len(seen)} partial copies (lengths {sorted(set(seen))[:5]} of {len(code)})"
    assert Path(path).read_text(encoding="utf-8") == code
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path / "cells")) == [os.path.basename(path)]  # no temporary file left
