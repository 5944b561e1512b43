"""clorch_repl.common.procs.wait_gone, which every stop and restart waits with (issue 39: woken by each
exit through a process descriptor, not by a poll): real child processes, which end, are zombies
(exited, not reaped: gone, as their GPU memory and descriptors are), or outlive the wait."""

from __future__ import annotations

import subprocess
import sys

import psutil

from clorch_repl.common.procs import wait_gone


def test_wait_gone_returns_what_still_runs_and_counts_zombies_as_gone() -> None:
    ends = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert wait_gone([ends.pid, zombie.pid], timeout_s=30) == []
        assert psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE  # exited, nobody reaped it yet
        assert wait_gone([stays.pid, ends.pid], timeout_s=0.2) == [stays.pid]
        assert wait_gone([], timeout_s=5) == []
    finally:
        stays.kill()
        for proc in (ends, stays, zombie):
            proc.wait()
