"""The rank supervisor (clorch_repl/host/supervisor.py) on its own, with real processes: what a
user notices as "the rank never started, and the log says why", "the notebook died while the rank
was starting and nothing was left behind", and a stop's grace reaching the rank's children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from clorch_repl.common.procs import pid_running, wait_gone
from clorch_repl.host import supervisor

# A child that ignores SIGTERM and says so: only SIGKILL (after the grace) ends it.
STUBBORN = ("import os, signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\"ready\", flush=True); time.sleep(1000)'], "
            "stdout=subprocess.PIPE, text=True)\n"
            "assert child.stdout.readline().strip() == 'ready'\n"
            "print('CHILD', child.pid, flush=True)\n"
            "os._exit(int(sys.argv[1]))\n")


def test_a_command_that_cannot_start_says_why_on_stderr() -> None:
    cmd = supervisor.command(sys.executable, 1.0, os.getpid(), ["/nonexistent/python", "-m", "x"])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 127
    assert "cannot start '/nonexistent/python'" in out.stderr and "No such file" in out.stderr, out.stderr


def test_a_parent_already_gone_ends_the_rank_at_once(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: the notebook died before the supervisor looked
    pid_file = str(tmp_path / "rank.pid")
    session_dir = tmp_path / "session"
    session_dir.mkdir()
    cmd = supervisor.command(sys.executable, 5.0, dead.pid, [sys.executable, "-c", "import time; time.sleep(60)"],
                             pid_file=pid_file, session_dir=str(session_dir))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t0 < 10, "the supervisor of an orphaned rank kept it running"
    kernel = supervisor.read_pid(pid_file)
    assert kernel is not None and wait_gone([kernel], 2) == []
    assert not session_dir.exists(), "the session's directory was left"
    assert proc.returncode != 0


def _leftover_end(tmp_path, exit_code: int, grace_s: float) -> float:
    """Seconds from the kernel's own exit (status ``exit_code``) to the supervisor's exit, with a
    child left behind that ignores SIGTERM."""
    script = tmp_path / "kernel.py"
    script.write_text(STUBBORN)
    cmd = supervisor.command(sys.executable, grace_s, os.getpid(), [sys.executable, str(script), str(exit_code)])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("CHILD"), line
        child = int(line.split()[1])
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == exit_code
        took = time.monotonic() - t0
        assert not pid_running(child), "the stubborn child outlived its supervisor"
        return took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_clean_exit_gives_leftovers_the_stop_grace_and_a_crash_does_not(tmp_path) -> None:
    # A clean exit is what %clorch stop's shutdown request gives: its children get --grace (3 s
    # here) before SIGKILL, as a stop promises; a rank that died gets LEFTOVER_GRACE_S only, so
    # its death is reported at once.
    clean = _leftover_end(tmp_path, 0, 3.0)
    assert 3.0 <= clean < 8.0, clean
    crashed = _leftover_end(tmp_path, 3, 3.0)
    assert crashed < 3.0 and crashed >= supervisor.LEFTOVER_GRACE_S * 0.9, crashed
