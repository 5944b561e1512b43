"""The notebooks as users see them: JupyterLab 4 in headless Chromium runs notebooks/quickstart.ipynb
and notebooks/distributed_training.ipynb with Run > Run All Cells, and the tests read the page;
a generated widgets notebook checks rank widgets cell by cell (tqdm.auto bars seen moving, a bar a
rank's thread fills after its cell ended, a slider moved by keyboard that reaches its rank only); a
generated stdin notebook answers a rank's ``input()`` in JupyterLab's own input box.

Everything is real: a private ``jupyter lab`` server (its kernels start in the notebooks' folder, a
copy of notebooks/ without the repository on PYTHONPATH, as a user's would), real rank kernels and
gloo groups, Debian's Chromium. Screenshots of each run go to tests/artifacts/browser/ (not
committed) for a person to look at. At the end the server is shut down and nothing it started may
still run. Deselect with ``-m "not browser"``; without chromium/chromedriver the tests skip, except
in CI (``CI`` set), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from typing import Any

import pytest

from lab_driver import ROOT, LabPage, LabServer, copy_notebook, wait_for, write_notebook as _write_notebook

pytestmark = pytest.mark.browser

RUN_ALL_TIMEOUT_S = 420.0  # a run took 22-26 s on a quiet machine; other tests share its 2 cores


def _interrupt_notebook(folder: str) -> str:
    return _write_notebook(folder, "interrupt.ipynb", (
        "%load_ext clorch_repl",
        "%clorch start --nproc 2",
        "%%distributed\nimport time\nprint(f'spinning on rank {rank}', flush=True)\nwhile True: time.sleep(0.05)",
        "%%distributed\nprint(f'rank {rank} is still here')",
        "%clorch stop",
    ))


def _widgets_notebook(folder: str) -> str:
    """A tqdm.auto bar that runs long enough to be watched moving, and a slider per rank."""
    return _write_notebook(folder, "widgets.ipynb", (
        "%load_ext clorch_repl",
        "%clorch start --nproc 2",
        "%%distributed\nimport time\nfrom tqdm.auto import tqdm\n"
        "for step in tqdm(range(40), desc=f'bar of rank {rank}'):\n    time.sleep(0.1)",
        "%%distributed\nimport threading\nbackground = tqdm(total=30, desc=f'background {rank}')\n"
        "def train_on():\n    for _ in range(30):\n        time.sleep(0.1)\n        background.update(1)\n"
        "    background.close()\nthreading.Thread(target=train_on).start()",
        "%%distributed\nimport ipywidgets as widgets\n"
        "slider = widgets.IntSlider(value=10 + rank, max=100, description=f'r{rank}')\nslider",
        "%%distributed\nprint(f'rank {rank} slider {slider.value}')",
        "%clorch stop",
    ))


def _stdin_notebook(folder: str) -> str:
    """input() on rank 1 only, then on both ranks at once (served in rank order)."""
    return _write_notebook(folder, "stdin.ipynb", (
        "%load_ext clorch_repl",
        "%clorch start --nproc 2",
        "%%distributed\nif rank == 1:\n    name = input('name? ')\n    print(f'hello {name}')\n"
        "else:\n    print('rank 0 asks nothing')",
        "%%distributed\nimport torch.distributed as dist\ndist.barrier()\n"
        "value = input(f'value for {rank}? ')\nprint(f'rank {rank} got {value}')",
        "%clorch stop",
    ))


def _by_rank(outputs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Rendered widgets grouped by the rank label line shown above each ([rank N])."""
    rank: int | None = None
    found: dict[int, list[dict[str, Any]]] = {}
    for out in outputs:
        if out["widget"]:
            assert rank is not None, f"a widget with no rank label above it: {outputs}"
            found.setdefault(rank, []).append(out)
            continue
        lines = out["text"].strip().splitlines()
        m = re.fullmatch(r"\[rank (\d+)\]", lines[-1].strip()) if lines else None
        if m:
            rank = int(m.group(1))
    return found


@pytest.fixture(scope="module")
def lab(lab_server: tuple[LabServer, LabPage]) -> tuple[LabServer, LabPage]:
    """The shared server (tests/browser/conftest.py), with this module's notebooks in its root."""
    notebooks = lab_server[0].root
    for name in ("quickstart.ipynb", "distributed_training.ipynb"):
        copy_notebook(os.path.join(ROOT, "notebooks", name), notebooks)
    _interrupt_notebook(notebooks)
    _widgets_notebook(notebooks)
    _stdin_notebook(notebooks)
    return lab_server


def _run_notebook(page: LabPage, name: str) -> dict[str, Any]:
    """Open a notebook, Run All, and read every cell's source, prompt, output text and tables."""
    page.open_notebook(name)
    try:
        took = page.run_all(RUN_ALL_TIMEOUT_S)
    finally:
        page.screenshot(name.replace(".ipynb", ""))
    cells = [{"source": page.cell_source(i), "prompt": page.prompt(i), "text": page.output_text(i),
              "tables": page.output_tables(i), "widgets": page.widget_outputs(i)} for i in range(page.cell_count())]
    print(f"{name}: Run All took {took:.1f} s in JupyterLab")
    return {"took": took, "cells": cells}


def _cell(run: dict[str, Any], starts_with: str, contains: str = "") -> dict[str, Any]:
    for cell in run["cells"]:
        if cell["source"].strip().startswith(starts_with) and contains in cell["source"]:
            return cell
    raise AssertionError(f"no cell starting with {starts_with!r} (containing {contains!r}) on the page")


@pytest.fixture(scope="module")
def quickstart(lab: tuple[LabServer, LabPage]) -> dict[str, Any]:
    return _run_notebook(lab[1], "quickstart.ipynb")


def test_quickstart_shows_live_rank_labelled_output(quickstart: dict[str, Any]) -> None:
    start = _cell(quickstart, "%clorch start")
    assert "2 rank(s) ready, gloo process group formed" in start["text"]
    collective = _cell(quickstart, "%%distributed", "dist.all_reduce(x)")
    assert "[ranks 0-1] sum over 2 ranks: [3.0, 3.0, 3.0]" in collective["text"]  # one line: the ranks agree
    failing = _cell(quickstart, "%%distributed", "only rank")
    assert "only rank 1 fails" in failing["text"] and "[rank 0] fine" in failing["text"]
    fresh = _cell(quickstart, "%%distributed", '"x" in globals()')
    assert "[ranks 0-1] False" in fresh["text"]  # the restart gave fresh namespaces
    assert "stopped 2 rank(s)" in _cell(quickstart, "%clorch stop")["text"]
    # every code cell ran (a number in its prompt), in the order of the notebook
    counts = [int(m.group(1)) for c in quickstart["cells"] if (m := re.search(r"\[(\d+)\]", c["prompt"]))]
    assert len(counts) == sum(1 for c in quickstart["cells"] if c["prompt"]) and counts == sorted(counts)


def test_quickstart_shows_the_status_table(quickstart: dict[str, Any]) -> None:
    status = _cell(quickstart, "%clorch status")
    assert len(status["tables"]) == 1, status["text"]
    header, *rows = status["tables"][0]
    assert header[:3] == ["rank", "state", "pid"]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[1] == "idle" for r in rows)
    assert all(r[2].isdigit() for r in rows) and all(r[4] == "gloo" for r in rows)


def test_quickstart_merges_identical_output(quickstart: dict[str, Any]) -> None:
    same = _cell(quickstart, "%%distributed", "print(x.sum().item())")
    assert re.search(r"\[(ranks 0-1|all ranks)\] 9\.0", same["text"]), same["text"]
    assert "[rank 0] 9.0" not in same["text"]  # shown once, not once per rank


def test_quickstart_widget_progress_bar_per_rank(quickstart: dict[str, Any]) -> None:
    """A ``tqdm.auto`` bar in a ``%%distributed`` cell renders as one widget bar per rank, under
    that rank's label, and ends full (its updates reached the page)."""
    cell = _cell(quickstart, "%%distributed", "tqdm(")
    assert "Error displaying widget" not in cell["text"] and "Loading widget" not in cell["text"], cell["text"]
    shown = _by_rank(cell["widgets"])
    assert list(shown) == [0, 1], cell["widgets"]  # in rank order on the page
    for rank, widgets in shown.items():
        (bar,) = widgets
        assert "steps" in bar["text"] and "20/20" in bar["text"], bar
        assert len(bar["bars"]) == 1 and bar["bars"][0] > 99, bar


def test_widget_bars_update_live_and_a_slider_change_reaches_its_rank(lab: tuple[LabServer, LabPage]) -> None:
    from selenium.webdriver.common.keys import Keys

    page = lab[1]
    page.open_notebook("widgets.ipynb")
    load, start, bar, background, slider, read, stop = (page.find_cell(s) for s in (
        "%load_ext", "%clorch start", "%%distributed\nimport time", "%%distributed\nimport threading",
        "%%distributed\nimport ipywidgets", "%%distributed\nprint", "%clorch stop"))
    for index in (load, start):
        page.run_cell(index)
        page.wait_idle(180)
    assert "2 rank(s) ready" in page.output_text(start), page.output_text(start)
    # the bars move while the cell runs (40 steps of 0.1 s): fills strictly between empty and full
    page.run_cell(bar)
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    deadline = time.monotonic() + 120
    wait_for(page.busy, 30, "the bar cell to start")
    while page.busy() and time.monotonic() < deadline:
        for rank, widgets in _by_rank(page.widget_outputs(bar)).items():
            seen[rank].update(round(v) for w in widgets for v in w["bars"])
        time.sleep(0.1)
    page.wait_idle(120)
    page.screenshot("widgets-bars")
    print(f"bar fills (%) seen while the cell ran: {({r: sorted(v) for r, v in seen.items()})}")
    final = _by_rank(page.widget_outputs(bar))
    for rank in (0, 1):
        moving = sorted(v for v in seen[rank] if 0 < v < 100)
        assert len(moving) >= 2, f"rank {rank}'s bar was seen at {sorted(seen[rank])} while the cell ran"
        (done,) = final[rank]
        assert done["bars"][0] > 99 and f"bar of rank {rank}" in done["text"] and "40/40" in done["text"], done
    # a bar a rank's thread keeps updating after its cell ended moves on while the notebook idles
    page.run_cell(background)
    page.wait_idle(60, settle=0.5)
    after_cell = {r: [v for w in ws for v in w["bars"]] for r, ws in _by_rank(page.widget_outputs(background)).items()}
    assert sorted(after_cell) == [0, 1] and all(v[0] < 100 for v in after_cell.values()), after_cell
    wait_for(lambda: all(w[0]["bars"] and w[0]["bars"][0] > 99 and "30/30" in w[0]["text"]
                         for w in _by_rank(page.widget_outputs(background)).values()), 60,
             "the background bars to fill with no cell running")
    assert not page.busy()
    print(f"background bars when their cell had ended: {after_cell}")
    # a slider per rank; moving rank 1's (5 steps right, by keyboard) reaches rank 1 only
    page.run_cell(slider)
    page.wait_idle(120)
    outputs = page.widget_outputs(slider)
    shown = _by_rank(outputs)
    assert [w[0]["readouts"] for _, w in sorted(shown.items())] == [["10"], ["11"]], shown
    nth = next(i for i, out in enumerate(o for o in outputs if o["widget"]) if out is shown[1][0])
    handle = page.slider_handle(slider, nth)
    handle.click()
    for _ in range(5):
        handle.send_keys(Keys.ARROW_RIGHT)
        time.sleep(0.1)
    wait_for(lambda: _by_rank(page.widget_outputs(slider))[1][0]["readouts"] == ["16"], 30,
             "rank 1's slider to read 16")
    page.wait_idle(60)  # the notebook kernel forwards the change to rank 1 and its echo back
    page.run_cell(read)
    wait_for(lambda: "rank 1 slider" in page.output_text(read), 120, "the ranks to print their sliders' values")
    page.wait_idle(60)
    page.screenshot("widgets-slider")
    text = page.output_text(read)
    assert "[rank 0] rank 0 slider 10" in text and "[rank 1] rank 1 slider 16" in text, text
    page.run_cell(stop)
    wait_for(lambda: "stopped 2 rank(s)" in page.output_text(stop), 120, "%clorch stop")
    page.wait_idle(60)


def test_training_notebook_runs_in_jupyterlab(lab: tuple[LabServer, LabPage]) -> None:
    checkpoint = os.path.join(tempfile.gettempdir(), "clorch-notebook-ddp.pt")  # the notebook's own
    sharded = os.path.join(tempfile.gettempdir(), "clorch-notebook-fsdp")  # and its FSDP2 folder
    if os.path.exists(checkpoint):
        os.unlink(checkpoint)
    try:
        run = _run_notebook(lab[1], "distributed_training.ipynb")
    finally:
        if os.path.exists(checkpoint):
            os.unlink(checkpoint)  # leave nothing behind in /tmp
        shutil.rmtree(sharded, ignore_errors=True)
    page_text = "\n".join(c["text"] for c in run["cells"])
    assert "ModuleNotFoundError" not in page_text and "Traceback" not in page_text, page_text[-3000:]
    # each rank's line once: merged ([ranks 0-1]) or, a copy later than the merge's hold, per rank
    for pattern in (r"512 samples per epoch on cpu, bfloat16", r"epoch 3, 24 steps"):
        labels = sorted(re.findall(rf"^\[(rank [01]|ranks 0-1)\] {pattern}", page_text, re.MULTILINE))
        assert labels in (["rank 0", "rank 1"], ["ranks 0-1"]), (pattern, labels, page_text[-3000:])
    resumed = set(re.findall(r"\] resumed at epoch 2, step 16, weights ([0-9a-f]{16})", page_text))
    saved = set(re.findall(r"\] weights ([0-9a-f]{16})", page_text))
    assert resumed == saved and len(saved) == 1, page_text[-3000:]  # identical replicas, resumed as saved
    assert "fsdp: 8 steps" in page_text and "resumed at step 8, 16 steps" in page_text
    assert "stopped 2 rank(s)" in page_text


def test_toolbar_interrupt_stops_the_running_cell_and_keeps_the_ranks(lab: tuple[LabServer, LabPage]) -> None:
    page = lab[1]
    page.open_notebook("interrupt.ipynb")
    spin, after, stop = page.find_cell("%%distributed\nimport time"), page.find_cell("%%distributed\nprint"), \
        page.find_cell("%clorch stop")
    page.menu("Run", "Run All Cells")
    wait_for(lambda: "spinning on rank 0" in page.output_text(spin) and "spinning on rank 1" in page.output_text(spin),
             RUN_ALL_TIMEOUT_S, "both ranks to print in the spinning cell")
    assert page.prompt(spin) == "[*]:"
    page.screenshot("interrupt-running")
    clicked = time.monotonic()
    page.toolbar_button("interrupt").click()
    page.wait_idle(120)
    took = time.monotonic() - clicked
    page.screenshot("interrupt-done")
    text = page.output_text(spin)
    assert "KeyboardInterrupt" in text, text
    # both ranks interrupted at the same line: one report block under one heading (issue 25)
    assert "---- ranks 0-1 ----" in text and "---- rank 0 ----" not in text, text
    assert page.output_text(after) == ""  # Run All stopped at the interrupted cell
    print(f"toolbar interrupt: idle again {took:.1f} s after the click")
    page.run_cell(after)
    wait_for(lambda: "rank 1 is still here" in page.output_text(after), 120, "the ranks to answer after the interrupt")
    page.wait_idle(120)
    assert "rank 0 is still here" in page.output_text(after)
    page.run_cell(stop)
    wait_for(lambda: "stopped 2 rank(s)" in page.output_text(stop), 120, "%clorch stop")
    page.wait_idle(60)
    page.screenshot("interrupt-after")


def _open_box(page: LabPage, index: int, prompt: str) -> None:
    """Wait for the cell's input box asking ``prompt``, open for typing (bounded)."""
    wait_for(lambda: any(b["open"] and b["prompt"] == prompt for b in page.stdin_boxes(index)), 120,
             f"JupyterLab's input box asking {prompt!r}")


def test_input_on_a_rank_is_answered_in_jupyterlabs_input_box(lab: tuple[LabServer, LabPage]) -> None:
    """A rank's ``input()`` shows JupyterLab's input box, its prompt naming the rank; what the user
    types there (Enter) reaches that rank, and the cell ends with both ranks' output. Two ranks
    asking at once get one box each, rank 0's first, rank 1's once rank 0's is answered."""
    page = lab[1]
    page.open_notebook("stdin.ipynb")
    load, start, one, both, stop = (page.find_cell(s) for s in (
        "%load_ext", "%clorch start", "%%distributed\nif rank == 1", "%%distributed\nimport torch", "%clorch stop"))
    for index in (load, start):
        page.run_cell(index)
        page.wait_idle(180)
    assert "2 rank(s) ready" in page.output_text(start), page.output_text(start)
    # one rank asks
    page.run_cell(one)
    try:
        _open_box(page, one, "[rank 1] name? ")
    finally:
        page.screenshot("stdin-asking")
    assert page.busy() and page.prompt(one) == "[*]:"  # the cell waits for the answer
    assert len(page.stdin_boxes(one)) == 1, page.stdin_boxes(one)
    page.answer_stdin(one, "Ada")
    wait_for(lambda: "hello Ada" in page.output_text(one), 120, "rank 1 to print the answer")
    page.wait_idle(120)
    page.screenshot("stdin-answered")
    text = page.output_text(one)
    assert "[rank 1] hello Ada" in text and "[rank 0] rank 0 asks nothing" in text, text
    assert "Error" not in text and not any(b["open"] for b in page.stdin_boxes(one)), (text, page.stdin_boxes(one))
    # both ranks ask at once: rank 0's box, then rank 1's own box after rank 0's is answered
    page.run_cell(both)
    _open_box(page, both, "[rank 0] value for 0? ")
    assert [b["prompt"] for b in page.stdin_boxes(both) if b["open"]] == ["[rank 0] value for 0? "]
    page.answer_stdin(both, "A")
    try:
        _open_box(page, both, "[rank 1] value for 1? ")
    finally:
        page.screenshot("stdin-second-rank")
    assert [b["prompt"] for b in page.stdin_boxes(both) if b["open"]] == ["[rank 1] value for 1? "]
    page.answer_stdin(both, "B")
    wait_for(lambda: "rank 1 got B" in page.output_text(both), 120, "rank 1 to print its answer")
    page.wait_idle(120)
    page.screenshot("stdin-both")
    text = page.output_text(both)
    assert "[rank 0] rank 0 got A" in text and "[rank 1] rank 1 got B" in text, text
    assert "Error" not in text, text
    page.run_cell(stop)
    wait_for(lambda: "stopped 2 rank(s)" in page.output_text(stop), 120, "%clorch stop")
    page.wait_idle(60)
