"""Issue 36 in JupyterLab: Kernel > Restart Kernel… after ``%clorch detach``, then ``%clorch
connect`` in the restarted kernel drives the same ranks (the same processes) with the variables
set before the restart. Clicked through the real menu and dialog in headless Chromium; a
screenshot goes to tests/artifacts/browser/.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

from clorch_repl.common.procs import pid_running, wait_gone
from lab_driver import LabPage, LabServer, wait_for, write_notebook

pytestmark = pytest.mark.browser

NAME = "lab-restart"


@pytest.fixture(scope="module")
def lab(lab_server: tuple[LabServer, LabPage]) -> tuple[LabServer, LabPage]:
    write_notebook(lab_server[0].root, "detach.ipynb", (
        "%load_ext clorch_repl",
        f"%clorch start --nproc 2 --name {NAME}",
        "%%distributed\nimport os\nx = rank * 10 + 7\nprint('rank', rank, 'pid', os.getpid(), 'set x')",
        "%clorch detach --keep-for 2m",
        f"%clorch connect {NAME}",
        "%%distributed\nprint('after the restart: rank', rank, 'pid', os.getpid(), 'x', x)",
        "%clorch stop",
    ))
    return lab_server


def _pids(text: str) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", text)}


def test_kernel_restart_then_connect_drives_the_same_ranks(lab: tuple[LabServer, LabPage]) -> None:
    page = lab[1]
    page.open_notebook("detach.ipynb")
    load, start, setx, detach, connect, check, stop = (page.find_cell(s) for s in (
        "%load_ext", "%clorch start", "%%distributed\nimport os", "%clorch detach", "%clorch connect",
        "%%distributed\nprint('after", "%clorch stop"))
    pids: dict[int, int] = {}
    try:
        for index in (load, start, setx, detach):
            page.run_cell(index)
            page.wait_idle(180)
        pids = _pids(page.output_text(setx))
        assert sorted(pids) == [0, 1], page.output_text(setx)
        assert f"session '{NAME}' detached" in page.output_text(detach), page.output_text(detach)
        # rank <- its supervisor <- the session's zygote (forked ranks) <- the notebook kernel
        kernels = [p for p in psutil.Process(pids[0]).parents() if "ipykernel" in " ".join(p.cmdline())]
        assert kernels, [p.cmdline() for p in psutil.Process(pids[0]).parents()]
        notebook = kernels[0]
        page.menu("Kernel", "Restart Kernel…")
        page.click_dialog_button("Restart")
        wait_for(lambda: not pid_running(notebook.pid), 60, "the notebook's kernel to end")
        wait_for(lambda: page.kernel_status() == "idle", 120, "the restarted kernel")
        time.sleep(1.0)
        assert all(pid_running(pid) for pid in pids.values()), "the ranks ended with the restarted kernel"
        for index in (load, connect, check):
            page.run_cell(index)
            page.wait_idle(180)
        connected, after = page.output_text(connect), page.output_text(check)
        page.screenshot_cell("detach-restart-connect", connect)
        print(f"after Kernel > Restart:\n{connected}\n{after}")
        assert f"connected to session '{NAME}': 2 gloo rank(s)" in connected, connected
        assert _pids(after) == pids, (pids, after)  # the same processes
        assert re.search(r"rank 0 pid \d+ x 7\b", after) and re.search(r"rank 1 pid \d+ x 17\b", after), after
        page.run_cell(stop)
        wait_for(lambda: "stopped 2 rank(s)" in page.output_text(stop), 120, "%clorch stop")
        page.wait_idle(60)
        assert wait_gone(list(pids.values()), 15) == []
    finally:
        for pid in pids.values():  # a failed run must not leave detached ranks for their keep-for
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
