"""Which ranks are dead, learnt in one look before every cell (``Launcher.dead``, issue 39), and
where each rank's log stood when its cell began (``RankFiles.cell_began``, through a descriptor
held open), on real local ranks: forked ones (pidfds) and fresh interpreters (no pidfd).

What a user would notice if either were wrong: a cell sent to a dead rank instead of refused, a
live rank reported dead, or a death report that shows the wrong part of the log."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterator

import pytest

from clorch_repl.common.procs import wait_gone
from clorch_repl.errors import ClorchError
from clorch_repl.launchers.local_rank import ended
from clorch_repl.session.engine import PlainSink, Session, local_session


@pytest.fixture(params=["forked", "fresh"])
def session(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    monkeypatch.setenv("CLORCH_FORK_RANKS", "1" if request.param == "forked" else "0")
    monkeypatch.setenv("CLORCH_SPARES", "0")
    started = local_session(3, "gloo")
    started.start()
    try:
        yield started
    finally:
        assert started.stop() == [], "a process was left behind"


def _kill(session: Session, rank: int) -> None:
    proc = session.group.ranks[rank]
    os.kill(proc.pid, signal.SIGKILL)
    wait_gone([proc.pid], timeout_s=10)
    deadline = time.monotonic() + 10
    while proc.alive and time.monotonic() < deadline:  # (its supervisor follows it, then the zygote reports)
        time.sleep(0.05)
    assert not proc.alive, f"rank {rank} was killed but still reads alive"


def test_the_one_look_names_exactly_the_dead_ranks(session: Session) -> None:
    group = session.group
    forked = session.group.ranks[0].process.__class__.__name__ == "ForkedProcess"
    assert all(getattr(p.process, "exit_fd", None) is not None for p in group.ranks) == forked
    assert group.dead() == [] and group.dead([2, 0]) == []
    _kill(session, 1)
    assert group.dead() == [1] and group.dead([0, 2]) == [] and group.dead([1]) == [1]
    assert group.dead() == [1], "asked again once the pidfd is closed"
    with pytest.raises(ClorchError, match="rank 1 .* died since the last cell, so this cell was not run"):
        session.run("print('ran')", None, 30, PlainSink())


def test_a_death_another_thread_learnt_of_first_is_seen_whatever_file_reuses_its_pidfd(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pidfd is closed once the exit is known (by whichever thread asked first: an interrupt
    asks from its own), and a new file may get its number at once: a quiet look at that file must
    not make the rank alive again."""
    monkeypatch.setenv("CLORCH_SPARES", "0")
    session = local_session(2, "gloo")
    session.start()
    try:
        proc = session.group.ranks[1]
        fd = proc.process.exit_fd
        assert fd is not None, "the ranks were not forked"
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.process.poll() is None and time.monotonic() < deadline:  # another thread's look
            time.sleep(0.05)
        assert proc.process.exit_fd is None and proc.returncode is None, "the case is not made"
        reader, writer = os.pipe()
        os.dup2(reader, fd)  # a quiet pipe under the closed pidfd's number
        try:
            assert ended(session.group.ranks) == [1]
        finally:
            for end in {fd, reader, writer}:  # (pipe() itself may have taken the number)
                os.close(end)
    finally:
        assert session.stop() == []


def test_a_death_report_starts_where_the_log_stood_when_its_cell_began(session: Session) -> None:
    """The log's end is read through a descriptor opened at the first cell; a rank started afresh
    after its log was removed (by hand, to free the disk) is read from the new file's end, not
    from the removed one's through the old descriptor."""
    assert session.run("import os, sys\nos.write(2, b'earlier cell\\n')", None, 30, PlainSink()).ok
    died = session.run("import os\nif rank == 1:\n    os.write(2, b'fatal cell\\n')\n    os._exit(3)", None, 60,
                       PlainSink())
    report = died.ranks[1].log_tail
    assert "fatal cell" in report and "earlier cell" not in report, report
    files = session.group.files[1]
    os.remove(files.log_path)
    session.restart(ranks=[1])
    size = os.path.getsize(files.log_path)
    assert session.run("pass", [1], 30, PlainSink()).ok
    assert files.cell_start == size, "the new kernel's cell read the log's end through the old descriptor"


def test_a_session_let_go_to_another_kernel_closes_its_log_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A detach (reattach.release) forgets the launcher without closing it: each rank's log reader
    stayed open in the kernel that let go, 64 at a 64-rank detach (a review)."""
    from clorch_repl.session.reattach import release

    monkeypatch.setenv("CLORCH_SPARES", "0")
    session = local_session(2, "gloo")
    session.start()
    group = session.group
    try:
        assert session.run("pass", None, 30, PlainSink()).ok
        readers = [files._log_reader for files in group.files]
        assert all(fd is not None for fd in readers)
        release(session)
        assert [files._log_reader for files in group.files] == [None, None]
        for fd in readers:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:
                target = ""
            assert not target.endswith(".log"), f"a log reader is still open: {target}"
    finally:
        assert group.stop() == []
        group.close()
