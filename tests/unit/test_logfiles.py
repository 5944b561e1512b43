"""Rank logs kept when their session's directory goes (issue 35), from the functions that do it:
only the logs move out (never a key, socket or store), into ``<dir>-logs``, private; a path that
is already someone else's or a link is not used; ``CLORCH_KEEP_LOGS=0`` keeps nothing; and the
colour codes a log holds are left out when it is shown. The same through a real notebook kernel's
stop and crash: tests/integration/test_notebook_kernel.py."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from clorch_repl.host.logfiles import KEEP_ENV, keep_logs, remove_keeping_logs, without_ansi


def session(tmp_path: Any) -> str:
    folder = tmp_path / "clorch-abc123"
    folder.mkdir(mode=0o700)
    for name, text in (("rank0.log", "zero\n"), ("rank1.log", "one\n"), ("rank1.log.1", "older\n"),
                       ("rank0.json", '{"key": "secret"}'), ("rendezvous-1.store", "x"), ("rank0.stack", "")):
        (folder / name).write_text(text)
    return str(folder)


def test_only_the_logs_are_kept_in_a_private_folder_beside(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_ENV, raising=False)  # the default: kept
    folder = session(tmp_path)
    kept = remove_keeping_logs(folder)
    assert kept == folder + "-logs" and not os.path.exists(folder)
    assert sorted(os.listdir(kept)) == ["rank0.log", "rank1.log", "rank1.log.1"]
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o700
    assert (tmp_path / "clorch-abc123-logs" / "rank1.log").read_text() == "one\n"


def test_a_folder_that_is_not_this_users_private_one_is_not_used(tmp_path: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_ENV, raising=False)
    folder = session(tmp_path)
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, folder + "-logs")  # planted where the logs would go
    kept = keep_logs(folder)
    assert kept != folder + "-logs" and os.path.basename(kept).startswith("clorch-abc123-logs-")
    assert os.listdir(target) == [] and sorted(os.listdir(kept)) == ["rank0.log", "rank1.log", "rank1.log.1"]


def test_keeping_turned_off_and_nothing_to_keep(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_ENV, "0")
    folder = session(tmp_path)
    assert remove_keeping_logs(folder) == "" and not os.path.exists(folder)
    assert not os.path.exists(folder + "-logs")
    monkeypatch.setenv(KEEP_ENV, "1")
    assert keep_logs(str(tmp_path / "gone")) == ""  # another rank's supervisor removed it first


def test_colour_codes_are_left_out_of_what_is_shown() -> None:
    coloured = "\x1b[31mValueError\x1b[39m: bad\n\x1b[38;5;28;01mif\x1b[39;00m x\n\x1b]8;;http://a\x07link\x1b]8;;\x07"
    assert without_ansi(coloured) == "ValueError: bad\nif x\nlink"
