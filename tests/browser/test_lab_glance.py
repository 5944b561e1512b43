"""Issue 38, as a user sees it in JupyterLab: a flood that never stalls the tab, reports that read
at a glance, a panel that follows a restart, rank widgets back after a reload.

The page's main thread is watched with the browser's own long-task observer (PerformanceObserver
'longtask'), and the Interrupt button's click is timed from the click to the page's first listener
for it: those are what a user feels as a frozen tab. Screenshots go to tests/artifacts/browser/.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from lab_driver import LabPage, LabServer, wait_for, write_notebook

pytestmark = pytest.mark.browser

FLOOD = "while True: print('x' * 100)"
#: The issue's goal: a flood never blocks the page's main thread over 250 ms. On the 2-core box the
#: page's own work during a 3-rank flood is small (0.23-0.32 s of main-thread CPU over the whole
#: flood); its tasks were long when they waited for a core that three ranks printing into held-back
#: output kept busy (longest 0-236 ms in 12 floods, 463-468 ms on a busier day). With those ranks
#: paced (clorch_repl/kernel/pace.py) 12 floods in the same runs gave one task over 50 ms (54 ms):
#: the goal holds with a margin of over 4x (docs/PERFORMANCE.md, "A flood in the browser").
LONGEST_TASK_MS = 250
CLICK_S = 0.5
#: every message clorch writes fits a notebook cell's width
COLUMNS = 100


@pytest.fixture(scope="module")
def lab(lab_server: tuple[LabServer, LabPage]) -> tuple[LabServer, LabPage]:
    root = lab_server[0].root
    write_notebook(root, "flood.ipynb", (
        "%load_ext clorch_repl",
        "%clorch start --nproc 3",
        f"%%distributed --timeout 5\n{FLOOD}",
        f"%%distributed --timeout 60\n{FLOOD}",
        "%%distributed\nprint('after the floods on rank', rank)",
        "%clorch stop",
        "%clorch run",
    ))
    write_notebook(root, "glance.ipynb", (
        "%load_ext clorch_repl",
        "%clorch start --nproc 3",
        "%clorch top",
        "%%distributed --hang-notice 5\nimport signal, time, torch.distributed as dist\nprint('in', flush=True)\n"
        "if rank == 2:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(60)\nelse:\n"
        "    dist.barrier()",
        "%clorch restart",
        "%%distributed\nprint('fresh rank', rank)",
        "%%distributed\nimport ipywidgets as widgets\nslider = widgets.IntSlider(value=10 + rank, description=f'r{rank}')\n"
        "slider",
        "%%distributed\nslider.value = 50 + rank",
        "%%distributed\nprint('slider of rank', rank, 'reads', slider.value)",
        "%clorch stop",
    ))
    return lab_server


def _clorch_lines(text: str) -> list[str]:
    """clorch's own messages in a cell's output (not a rank's lines, not IPython's tracebacks):
    lines that start with ``clorch`` or ``Timed out``, and the lines that continue them (wrapped,
    indented by two spaces)."""
    found, inside = [], False
    for line in text.splitlines():
        inside = line.startswith(("clorch", "Timed out")) or (inside and line.startswith("  ") and line.strip() != "")
        if inside:
            found.append(line)
    return found


def test_a_three_rank_flood_never_stalls_the_page(lab: tuple[LabServer, LabPage]) -> None:
    page = lab[1]
    page.open_notebook("flood.ipynb")
    load, start, timed, clicked, after, stop = (page.find_cell(s) for s in (
        "%load_ext", "%clorch start", "%%distributed --timeout 5", "%%distributed --timeout 60",
        "%%distributed\nprint", "%clorch stop"))
    for index in (load, start):
        page.run_cell(index)
        page.wait_idle(180)
    assert "3 rank(s) ready" in page.output_text(start), page.output_text(start)
    # a flood ended by its --timeout
    since = page.watch_main_thread()
    began = time.monotonic()
    page.run_cell(timed)
    wait_for(page.busy, 30, "the flood to start")
    page.wait_idle(120, settle=0.5)
    took = time.monotonic() - began
    tasks = page.long_tasks(since)
    page.screenshot_cell("flood-timeout", timed)
    text = page.output_text(timed)
    shown = text.count("x" * 100)
    print(f"flood ended by --timeout 5: idle {took:.1f} s after the run; {shown} lines on the page; "
          f"long tasks (ms): {sorted(tasks, reverse=True)[:10]} of {len(tasks)}")
    held = page.output_offset(timed, "held back")
    print(f"held-back line at {held}")
    # the flood ended by its timeout: a timeout, not a hang; nothing of clorch's own frames
    assert "Timed out" in text, text[-2000:]
    assert "Why" not in text and "output.py" not in text and "_echo" not in text, text[-3000:]
    # the held-back line is the cell's first output, seen without scrolling
    assert held is not None and held["in_area"] < 40 and 0 <= held["in_view"] < held["view"] - 40, held
    said = _clorch_lines(text)
    assert said and all(len(line) <= COLUMNS for line in said), said
    # a flood the user ends with Interrupt
    since = page.watch_main_thread()
    page.run_cell(clicked)
    wait_for(lambda: "x" * 100 in page.output_text(clicked), 60, "the second flood to reach the page")
    time.sleep(1.5)
    button = page.toolbar_button("interrupt")
    click = page.timed_click(button)
    page.wait_idle(120, settle=0.5)
    tasks += page.long_tasks(since)
    page.screenshot_cell("flood-interrupted", clicked)
    print(f"Interrupt clicked during the flood: the page saw it after {click:.3f} s; "
          f"longest tasks (ms) over both floods: {sorted(tasks, reverse=True)[:10]}")
    assert "KeyboardInterrupt" in page.output_text(clicked)
    assert click < CLICK_S, f"the Interrupt click took {click:.2f} s to register"
    assert max(tasks, default=0) <= LONGEST_TASK_MS, f"the main thread was blocked for {max(tasks):.0f} ms"
    page.run_cell(after)
    wait_for(lambda: "after the floods on rank" in page.output_text(after), 60, "the next cell")
    page.wait_idle(60)
    assert "held back" not in page.output_text(after) and "x" * 100 not in page.output_text(after)
    page.run_cell(stop)
    wait_for(lambda: "stopped 3 rank(s)" in page.output_text(stop), 120, "%clorch stop")
    page.wait_idle(60)
    # a refused command (IPython's UsageError) is wrapped between words like clorch's other messages
    refused = page.find_cell("%clorch run")
    page.run_cell(refused)
    wait_for(lambda: "UsageError" in page.output_text(refused), 60, "the refusal")
    page.wait_idle(60)
    text = page.output_text(refused)
    assert "%clorch run needs a SCRIPT: %clorch run [options] SCRIPT" in " ".join(text.split()), text
    assert len(text.strip().splitlines()) > 1 and all(len(line) <= COLUMNS for line in text.splitlines()), text
    page.screenshot_cell("refused", refused)


def test_a_hang_report_reads_at_a_glance_and_the_panel_follows_a_restart(lab: tuple[LabServer, LabPage]) -> None:
    """Interrupting a 3-rank hang (ranks 0-1 in a barrier rank 2 never calls; rank 2 ignores the
    interrupt, so that one rank stays stuck after the group's recovery frees the others) gave about 60 lines:
    the verdict three times, the waiting ranks' stack twice (once with full site-packages paths),
    advice to interrupt again. Now: the verdict once, one stack, short paths, advice that works.
    The %clorch top panel then follows the restart (it stayed at "the ranks stopped")."""
    page = lab[1]
    page.open_notebook("glance.ipynb")
    load, start, top, hang, restart, fresh, stop = (page.find_cell(s) for s in (
        "%load_ext", "%clorch start", "%clorch top", "%%distributed --hang-notice", "%clorch restart",
        "%%distributed\nprint", "%clorch stop"))
    for index in (load, start, top):
        page.run_cell(index)
        page.wait_idle(180)
    assert "3 rank(s) ready" in page.output_text(start), page.output_text(start)
    page.run_cell(hang)
    wait_for(lambda: "no progress on any rank" in page.output_text(hang), 90, "the live hang notice")
    page.toolbar_button("interrupt").click()
    page.wait_idle(120)
    page.screenshot_cell("hang-report", hang)
    text = page.output_text(hang)
    lines = [line for line in text.splitlines() if line.strip()]
    print(f"the 3-rank hang report: {len(lines)} lines\n{text}")
    verdict = "barrier #2 (default group): ranks 0-1 wait in it"
    assert " ".join(text.split()).count(verdict) == 1, text  # said once (the live notice)
    assert text.count("time.sleep(60)") == 1, text  # rank 2's stack once (not also faulthandler's)
    assert "/site-packages/" not in text and "%clorch interrupt" not in text, text
    assert "%clorch restart" in text and len(lines) <= 40, text
    assert all(len(line) <= 100 for line in lines if not line.startswith(("[rank", "  "))), text
    # the panel shows the stuck ranks' cell, the line they are at and for how long (it showed "-")
    stuck = wait_for(lambda: re.search(r"\b2\s+here\s+busy\s+\[\d+\] line 5: time\.sleep\(60\)\s+\d+s",
                                       page.output_text(top)), 30, "the panel to show the stuck rank's line")
    page.screenshot_cell("top-stuck", top)
    print(f"the panel's row of a stuck rank: {stuck.group(0)!r}")
    # the panel, during the restart and after it: the new ranks, not "the ranks stopped"
    page.run_cell(restart)
    page.wait_idle(180)
    restarted = page.output_text(restart)
    waited = re.search(r"formed in ([\d.]+) s", restarted)
    assert waited, restarted
    wait_for(lambda: re.search(r"\b2\s+here\s+idle", page.output_text(top)), 30, "the panel to show the new ranks")
    panel = page.output_text(top)
    page.screenshot_cell("top-after-restart", top)
    print(f"the panel after %clorch restart ({restarted.strip()}):\n{panel}")
    assert "stopped" not in panel and "starting at" not in panel and "\x1b" not in panel, panel
    page.run_cell(fresh)
    wait_for(lambda: "fresh rank" in page.output_text(fresh), 60, "the new ranks to run a cell")
    page.wait_idle(60)
    _reload_shows_the_rank_widgets(page)
    stop = page.find_cell("%clorch stop")
    top = page.find_cell("%clorch top")
    page.run_cell(stop)
    wait_for(lambda: "stopped 3 rank(s)" in page.output_text(stop), 120, "%clorch stop")
    page.wait_idle(60)
    wait_for(lambda: "no ranks running" in page.output_text(top), 30, "the panel to say the ranks stopped")


def _sliders(page: LabPage, index: int) -> list[str]:
    return sorted(r for out in page.widget_outputs(index) for r in out["readouts"])


def _reload_shows_the_rank_widgets(page: LabPage) -> None:
    """A slider per rank, each moved on its rank; after a page reload (as after an autosave, or in
    a second tab) the sliders are drawn again with their current values, and still reach their
    ranks (README used to say a reload would not bring them back)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    made, moved = page.find_cell("%%distributed\nimport ipywidgets"), page.find_cell("%%distributed\nslider.value")
    page.run_cell(made)
    wait_for(lambda: _sliders(page, made) == ["10", "11", "12"], 60, "a slider per rank")
    page.wait_idle(60)
    page.run_cell(moved)
    page.wait_idle(60)
    wait_for(lambda: _sliders(page, made) == ["50", "51", "52"], 30, "the sliders to follow their ranks")
    ActionChains(page.driver).key_down(Keys.CONTROL).send_keys("s").key_up(Keys.CONTROL).perform()
    time.sleep(1.5)  # saved: a reload shows the notebook as saved, its outputs naming the widgets
    page.driver.refresh()
    wait_for(lambda: page.cell_count() > 0 and page.kernel_status() == "idle", 120, "the notebook after the reload")
    made = page.find_cell("%%distributed\nimport ipywidgets")
    try:
        wait_for(lambda: _sliders(page, made) == ["50", "51", "52"], 30, "the rank widgets after the reload")
    finally:
        page.screenshot_cell("reload-widgets", made)
    text = page.output_text(made)
    assert "Error displaying widget" not in text and "model not found" not in text, text
    print(f"after a reload, the rank sliders read {_sliders(page, made)}")
    # still live: rank 1's slider moved by keyboard reaches rank 1
    nth = [i for i, out in enumerate(o for o in page.widget_outputs(made) if o["widget"]) if out["readouts"] == ["51"]]
    handle = page.slider_handle(made, nth[0])
    handle.click()
    for _ in range(5):
        handle.send_keys(Keys.ARROW_RIGHT)
        time.sleep(0.1)
    wait_for(lambda: _sliders(page, made) == ["50", "52", "56"], 30, "rank 1's slider to read 56")
    page.wait_idle(60)
    read = page.find_cell("%%distributed\nprint('slider of rank'")
    page.run_cell(read)
    wait_for(lambda: "slider of rank 2" in page.output_text(read), 60, "the ranks to read their sliders")
    page.wait_idle(60)
    text = page.output_text(read)
    assert "[rank 1] slider of rank 1 reads 56" in text and "[rank 0] slider of rank 0 reads 50" in text, text
