"""The head start in a real notebook kernel with real ranks (clorch_repl.magics.head_start).

A ``%%distributed`` cell is sent to the ranks from ipykernel's shell handler, before IPython
handles the cell; these tests make that visible to the notebook: a ``pre_run_cell`` callback (which
IPython runs before it transforms the cell, long before the magic) waits for a file that rank 0's
run of the cell writes. With the head start the file comes while the callback waits; with
``CLORCH_HEAD_START=0`` the ranks are not sent the cell until the magic runs, after the callback,
so the file cannot come while it waits. And a cell that IPython fails before reaching the magic
(here: an input transformer that raises on IPython's own reading) leaves no rank running it.
The pure half (the reading of the cell against IPython's) is tests/unit/test_head_start_reading.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from notebook_kernel import NotebookKernel, clorch_session
from rank_text import lines_of

#: registered in the notebook kernel: pre_run_cell waits (up to _head_wait_s) for the marker file
#: of the cell and records whether it came while it waited
WAITER = """
import os, time
_head_start_seen = []
_head_wait_s = {wait_s}
def _wait_for_marker(info):
    if not info.raw_cell.startswith("%%distributed") or "MARKER" not in info.raw_cell:
        return
    marker = info.raw_cell.split("MARKER=", 1)[1].split("'", 2)[1]
    deadline = time.monotonic() + _head_wait_s
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    _head_start_seen.append(os.path.exists(marker))
get_ipython().events.register("pre_run_cell", _wait_for_marker)
"""
WAIT_S = 10.0


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    with clorch_session() as kernel:
        assert kernel.run(WAITER.format(wait_s=WAIT_S)).status == "ok"
        yield kernel


def marker_cell(path: Path) -> str:
    return f"%%distributed\nMARKER='{path}'\nif rank == 0:\n    open(MARKER, 'w').close()\nprint('ran', rank)\n"


def test_the_ranks_run_the_cell_while_the_notebook_kernel_has_not_reached_the_magic(
        nb: NotebookKernel, tmp_path: Path) -> None:
    started = time.monotonic()
    reply = nb.run(marker_cell(tmp_path / "marker"), timeout=60)
    assert reply.status == "ok", reply.text
    assert nb.run("print(_head_start_seen[-1])").text.strip() == "True"
    assert time.monotonic() - started < WAIT_S  # the callback did not wait its limit out
    for r in (0, 1):
        assert lines_of(reply.text, r) == ["ran " + str(r)], reply.text


def test_with_the_head_start_off_the_ranks_wait_for_the_magic(nb: NotebookKernel, tmp_path: Path) -> None:
    assert nb.run("%env CLORCH_HEAD_START=0").status == "ok"
    try:
        assert nb.run("_head_wait_s = 1.0").status == "ok"  # it cannot come: the wait only costs time
        reply = nb.run(marker_cell(tmp_path / "marker"), timeout=60)
        assert reply.status == "ok", reply.text
        assert nb.run("print(_head_start_seen[-1])").text.strip() == "False"
        assert (tmp_path / "marker").exists()  # the ranks ran it, after the callback gave up
        for r in (0, 1):
            assert lines_of(reply.text, r) == ["ran " + str(r)], reply.text
    finally:
        assert nb.run(f"%env CLORCH_HEAD_START=1\n_head_wait_s = {WAIT_S}").status == "ok"


def test_a_cell_ipython_fails_before_the_magic_is_interrupted_on_the_ranks(nb: NotebookKernel) -> None:
    # A cleanup transform that passes the head start's reading of the cell and raises on every
    # later one (IPython's own readings): IPython fails the cell before calling the magic.
    setup = """
_readings = []
def _fail_second_reading(lines):
    if lines and "FAIL_BEFORE_MAGIC" in "".join(lines):
        _readings.append(1)
        if len(_readings) > 1:
            raise ValueError("the transform failed")
    return lines
get_ipython().input_transformers_cleanup.append(_fail_second_reading)
"""
    assert nb.run(setup).status == "ok"
    try:
        started = time.monotonic()
        reply = nb.run("%%distributed\n# FAIL_BEFORE_MAGIC\nimport time\nprint('started', rank, flush=True)\n"
                       "time.sleep(120)\n", timeout=60)
        assert time.monotonic() - started < 30, "the ranks ran the cell on instead of being interrupted"
        assert reply.status == "error", reply.text
        assert "the transform failed" in reply.text, reply.text
        assert "ended before %%distributed ran" in reply.text, reply.text
        assert "interrupted" in reply.text, reply.text
    finally:
        assert nb.run("get_ipython().input_transformers_cleanup.remove(_fail_second_reading)").status == "ok"
    after = nb.run("%%distributed\nprint('free', rank)", timeout=30)
    assert after.status == "ok", after.text
    for r in (0, 1):
        assert lines_of(after.text, r) == ["free " + str(r)], after.text
