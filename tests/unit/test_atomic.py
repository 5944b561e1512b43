"""Atomic file replacement (clorch_repl.common.atomic): a reader sees the old file or the new one, and a
failed write leaves nothing behind. The SIGKILL-mid-write case is in test_checkpoint.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from clorch_repl.common.atomic import write_atomically, write_json_atomic


def test_json_is_private_and_whole(tmp_path: Path) -> None:
    target = tmp_path / "rank-0.result.json"
    write_json_atomic(str(target), {"rank": 0, "ok": True})
    write_json_atomic(str(target), {"rank": 0, "ok": False})
    assert json.loads(target.read_text()) == {"rank": 0, "ok": False}
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # args and results are the user's data
    assert os.listdir(tmp_path) == ["rank-0.result.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")

    def half_then_fail(_tmp: str, fd: int) -> None:
        os.write(fd, b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(str(target), half_then_fail)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.pt"]


def test_before_replace_runs_while_the_old_file_is_still_in_place(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.write_bytes(b"old")
    seen: list[bytes] = []
    write_atomically(str(target), lambda _tmp, fd: os.write(fd, b"new"), mode=0o644,
                     before_replace=lambda: seen.append(target.read_bytes()))
    assert seen == [b"old"] and target.read_bytes() == b"new"
