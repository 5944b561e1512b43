"""ForkedProcess (launchers/forked.py): the handle of a rank's supervisor that is the zygote's
child. A real process stands in for the supervisor (so its pidfd is real); the zygote, which
reports the exit status after it reaps the child, is a stand-in that this test's own reaping
drives (starting ranks from a real zygote is what tests/integration/test_forked_start.py does).
The last test closes a real zygote (Zygote) under a fork waiting in another thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Iterator

import pytest

from clorch_repl.launchers.forked import ForkedProcess


class _Zygote:
    """The zygote's side of ForkedProcess: the status once reported, and how often it was asked."""

    def __init__(self) -> None:
        self.exits: dict[int, int] = {}
        self.asked = 0
        self.gone = False

    def returncode(self, pid: int) -> int | None:
        self.asked += 1
        return self.exits.get(pid)


@pytest.fixture
def child() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_running_supervisor_is_not_asked_of_the_zygote_and_its_exit_is(child) -> None:
    zygote = _Zygote()
    handle = ForkedProcess(child.pid, zygote)  # type: ignore[arg-type]
    for _ in range(100):  # the dead-or-busy check before every cell, for every rank
        assert handle.poll() is None
    assert zygote.asked == 0, "a running supervisor's status was asked of the zygote's socket"
    child.kill()
    child.wait()  # this test plays the zygote: it reaps, then reports
    assert handle.poll() is None  # exited, not yet reported: asked, and not known
    assert zygote.asked >= 1
    zygote.exits[child.pid] = -signal.SIGKILL
    assert handle.poll() == -signal.SIGKILL
    assert handle.poll() == -signal.SIGKILL and handle._pidfd is None  # closed once known
    handle.kill()  # a signal to an exited process is nothing (no reused pid is signalled)


def test_threads_that_poll_and_signal_the_same_process_at_once_never_fail(child) -> None:
    # an interrupt asks whether a rank is alive from its own thread while the relay's thread
    # checks the same rank before a cell (a shared select.poll object raised "concurrent poll()")
    zygote = _Zygote()
    handle = ForkedProcess(child.pid, zygote)  # type: ignore[arg-type]
    errors: list[BaseException] = []
    seen: list[int | None] = []
    stop = threading.Event()

    def hammer() -> None:
        try:
            while not stop.is_set():
                code = handle.poll()
                if code is not None:
                    seen.append(code)
                    handle.send_signal(signal.SIGTERM)  # after the exit: nothing, and no error
                    return
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    child.kill()
    child.wait()
    zygote.exits[child.pid] = -signal.SIGKILL
    for thread in threads:
        thread.join(10)
    stop.set()
    assert errors == []
    assert seen == [-signal.SIGKILL] * 4


def test_a_fork_waiting_in_another_thread_when_the_zygote_is_closed_is_told_it_ended(tmp_path) -> None:
    """A start interrupted while jupyter_client's thread waits in ``Zygote.fork`` (for the zygote's
    imports) stops the ranks, which closes the zygote under that wait: the wait must end with the
    launcher's own error, not an OSError from a closed descriptor (a CI run logged
    "[Errno 9] Bad file descriptor" from ``_receive``). A real zygote: its imports take seconds."""
    from clorch_repl.launchers.forked import Zygote, ZygoteError

    zygote = Zygote(str(tmp_path / "zygote.log"))
    raised: list[BaseException] = []

    def fork() -> None:
        try:
            zygote.fork([sys.executable, "-c", "pass"], {}, str(tmp_path), 2)
        except BaseException as exc:  # what the thread ended with is the test's subject
            raised.append(exc)

    waiter = threading.Thread(target=fork)
    waiter.start()
    threading.Event().wait(0.3)  # inside the wait for the zygote's imports (torch: seconds)
    assert not zygote._ready, "the zygote finished its imports before the test could close it under a wait"
    zygote.close()
    waiter.join(10)
    assert not waiter.is_alive() and len(raised) == 1
    assert isinstance(raised[0], ZygoteError), repr(raised[0])
    # and it exited, quietly: its "ready" found the notebook's end closed, which is how a zygote
    # learns the notebook is gone (an interrupted start's log held a BrokenPipeError's traceback)
    assert zygote.process.poll() == 0, zygote.process.poll()
    log = (tmp_path / "zygote.log").read_text()
    assert "Traceback" not in log, log


def test_a_handle_let_go_before_its_exit_was_reported_gives_its_pidfd_back(child) -> None:
    """A session that ends before the zygote reported a rank's exit drops the rank's handle with
    its pidfd open: every session left one or two descriptors in the notebook's process."""
    import gc
    import os

    handle = ForkedProcess(child.pid, _Zygote())  # type: ignore[arg-type]
    fd = handle.exit_fd
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    del handle
    gc.collect()
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        target = ""
    assert target != "anon_inode:[pidfd]", "the dropped handle's pidfd is still open"
