"""A rank's log bounded on disk (host/logcap.py): the rotation, the reader across it, the note
on what was dropped and the cap's setting. Pure file work in a temporary directory: fast."""

from __future__ import annotations

import os

import pytest

from clorch_repl.host import logcap
from clorch_repl.host.rankfiles import RankFiles, log_tail

CAP = logcap.MIN_CAP  # 64 KiB: a rotation past 32 KiB


def write_lines(path: str, first: int, count: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for i in range(first, first + count):
            os.write(fd, f"line {i:06d} {'x' * 40}\n".encode())
    finally:
        os.close(fd)


def on_disk(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, logcap.older_path(path)) if os.path.exists(p))


def test_a_log_past_half_the_cap_is_rotated_and_the_oldest_part_dropped_with_a_note(tmp_path) -> None:
    path = str(tmp_path / "rank0.log")
    line = len(f"line {0:06d} {'x' * 40}\n")
    total = 0
    for batch in range(40):  # 40 x 100 lines: about 212 KiB, more than three times the cap
        write_lines(path, batch * 100, 100)
        total += 100 * line
        logcap.rotate(path, CAP)
        assert on_disk(path) <= CAP + 100 * line + 512  # the cap, one batch between looks, the note
    text = log_tail(path, None)
    dropped = logcap.dropped_bytes(path)
    assert dropped > 0 and text.startswith(f"[clorch_repl: the oldest ")
    assert f"{dropped} bytes" in text.splitlines()[0] and logcap.CAP_ENV in text.splitlines()[0]
    kept = [l for l in text.splitlines() if l.startswith("line ")]
    # the newest lines are all there, in order, up to the last one written, and nothing else is lost
    numbers = [int(l.split()[1]) for l in kept]
    assert numbers == list(range(numbers[0], 4000))
    assert dropped == numbers[0] * line
    assert len(kept) * line >= CAP // 2


def test_a_tail_reads_across_the_rotation(tmp_path) -> None:
    path = str(tmp_path / "rank0.log")
    write_lines(path, 0, 1000)  # 53 KiB: rotated, nothing left in the log itself
    assert logcap.rotate(path, CAP) == 0 and os.path.getsize(path) == 0
    write_lines(path, 1000, 2)
    assert log_tail(path, 4).splitlines() == [f"line {i:06d} {'x' * 40}" for i in range(998, 1002)]
    assert logcap.note(path) == ""  # rotated once: nothing dropped yet, and nothing said


def test_a_small_log_is_left_alone_and_no_cap_means_none(tmp_path) -> None:
    path = str(tmp_path / "rank0.log")
    write_lines(path, 0, 100)
    assert logcap.rotate(path, CAP) == -1
    write_lines(path, 100, 2000)
    assert logcap.rotate(path, 0) == -1 and not os.path.exists(logcap.older_path(path))


def test_the_dead_kernels_part_is_found_after_a_rotation(tmp_path) -> None:
    files = RankFiles(str(tmp_path), 0)
    os.close(files.open_log())  # the first kernel
    write_lines(files.log_path, 0, 10)
    os.close(files.open_log())  # a restart: the current kernel's part starts here
    write_lines(files.log_path, 10, 1000)
    logcap.rotate(files.log_path, CAP)
    write_lines(files.log_path, 1010, 3)
    tail = files.current_log_tail(2000).splitlines()
    assert tail[0] == f"line {10:06d} {'x' * 40}" and tail[-1] == f"line {1012:06d} {'x' * 40}"


@pytest.mark.parametrize("raw, value", [("", logcap.DEFAULT_CAP), ("0", 0), ("1M", 1 << 20),
                                        ("512k", 512 << 10), ("100000", 100000)])
def test_the_cap_is_read_from_its_variable(raw: str, value: int) -> None:
    assert logcap.cap_from_env({logcap.CAP_ENV: raw}) == value


@pytest.mark.parametrize("raw", ["lots", "1k", "-5M"])
def test_a_cap_that_cannot_be_used_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=logcap.CAP_ENV):
        logcap.parse_cap(raw)


def test_a_reader_during_a_rotation_finds_the_newest_lines(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log is emptied only once its copy is ``PATH.1``: a reader at that moment (``%clorch
    logs`` right after a flood) read an empty log and no older half, and showed one empty line."""
    path = str(tmp_path / "rank0.log")
    write_lines(path, 0, 1000)  # past half the cap: a first rotation, no PATH.1 yet
    seen = []
    truncate = os.truncate

    def reading_around(name, length):  # type: ignore[no-untyped-def]
        seen.append(log_tail(path, 2).splitlines())  # what a reader sees just before the log empties
        truncate(name, length)
        seen.append(log_tail(path, 2).splitlines())  # and just after, before the rotation returns

    monkeypatch.setattr(logcap.os, "truncate", reading_around)
    assert logcap.rotate(path, CAP) == 0
    monkeypatch.undo()
    assert seen == [[f"line {i:06d} {'x' * 40}" for i in (998, 999)]] * 2, seen
    assert os.path.getsize(path) == 0
    assert log_tail(path, 2).splitlines() == [f"line {i:06d} {'x' * 40}" for i in (998, 999)]
