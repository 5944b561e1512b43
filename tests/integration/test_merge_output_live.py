"""Merging of identical rank output through a real notebook kernel and ranks, and one case of the
display alone that is not in the unit half. The display fed by hand: tests/unit/test_merge_output.py
(whose helpers these tests share)."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from test_merge_output import _shell, feed, out  # noqa: F401  (_shell: its autouse fixture)


def test_a_line_ended_late_after_another_ranks_line_adds_no_empty_line(monkeypatch: Any) -> None:
    """``print`` writes a line and its newline apart; a loaded rank can flush between them and
    send the newline later than the unfinished line's hold. The line is then shown unfinished,
    another rank's line ends it on screen, and the late newline has nothing left to end: it
    used to show as an empty ``[rank 0]`` line (seen once in the full suite, under load)."""
    import clorch_repl.notebook.display as display

    monkeypatch.setattr(display, "PARTIAL_LINE_HOLD_S", 0.0)  # both holds over: the rank is that late
    monkeypatch.setattr(display, "MERGE_HOLD_S", 0.0)
    cap = feed([out(0, "after 5"), out(1, "after 5\n"), out(0, "\n"), out(0, "next\n")])
    assert cap.stdout == "[rank 0] after 5\n[rank 1] after 5\n[rank 0] next\n", cap.stdout
    # an empty line a rank prints on purpose is still shown
    cap = feed([out(0, "\n"), out(1, "x\n"), out(0, "y\n")], merge=False)
    assert cap.stdout == "[rank 0] \n[rank 1] x\n[rank 0] y\n", cap.stdout


# ------------------------------------------------------- through a real notebook kernel and ranks
@pytest.fixture(scope="module")
def nb() -> Any:
    from notebook_kernel import clorch_session

    with clorch_session() as kernel:
        yield kernel


def stdout_of(reply: Any) -> str:
    return "".join(m["content"]["text"] for m in reply.outputs
                   if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")


def test_kernel_same_line_on_both_ranks_is_one_merged_line(nb: Any) -> None:
    reply = nb.run("%%distributed\nprint('hello from every rank')\nprint('I am rank', rank)")
    assert reply.status == "ok", reply.text
    text = stdout_of(reply)
    assert text.count("hello from every rank") == 1 and "[ranks 0-1] hello from every rank\n" in text
    assert "[rank 0] I am rank 0\n" in text and "[rank 1] I am rank 1\n" in text


def test_kernel_no_merge_keeps_each_ranks_copy(nb: Any) -> None:
    reply = nb.run("%%distributed --no-merge\nprint('copy')")
    assert reply.status == "ok", reply.text
    assert "[rank 0] copy\n" in stdout_of(reply) and "[rank 1] copy\n" in stdout_of(reply)


def test_kernel_identical_value_shown_once(nb: Any) -> None:
    reply = nb.run("%%distributed\n6 * 7")
    shown = [m["content"]["data"]["text/plain"] for m in reply.outputs if m["msg_type"] == "display_data"]
    assert shown == ["[ranks 0-1] 42"]


def test_kernel_interrupt_shows_one_keyboardinterrupt_numbered_like_the_notebook(nb: Any) -> None:
    for _ in range(3):  # local cells: the notebook's count runs ahead of the ranks' own
        assert nb.run("x = 1").status == "ok"
    msg_id = nb.send("%%distributed\nimport time\nprint('spinning', flush=True)\nwhile True: time.sleep(0.01)")
    nb.wait_for_ranks(msg_id, "spinning")
    time.sleep(0.3)  # both ranks are in the loop
    nb.km.interrupt_kernel()  # what Kernel > Interrupt does
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "error"
    plain = re.sub(r"\x1b\[[0-9;]*m", "", reply.text)
    assert plain.count("---- ranks 0-1 ----") == 1 and "---- rank 0 ----" not in plain
    assert plain.count("Traceback (most recent call last)") == 1
    cells = nb.run("print('CELL', [i for i, c in enumerate(In) if 'spinning' in c][0])")
    count = int(re.search(r"CELL (\d+)", cells.text).group(1))
    assert f"Cell In[{count}], line 3" in plain, plain
    after = nb.run("%%distributed\nraise ValueError(f'bad {rank}')")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", after.text)
    assert f"Cell In[{count + 2}], line 1" in plain  # numbered again after the local cell between
    assert "---- rank 0 ----" in plain and "---- rank 1 ----" in plain  # different errors: per rank


def test_kernel_a_warning_from_a_cell_is_one_merged_block(nb: Any) -> None:
    """A warning names the cell's line by its file: ipykernel's folder held each rank's pid
    (``[rank 0] /tmp/ipykernel_22483/2255580287.py:2: UserWarning``, ``[rank 1] /tmp/ipykernel_22488/...``),
    so every rank's copy differed and none merged. The ranks now share one folder of the user's,
    private to the user; IPython's tracebacks still name the cell ``Cell In[n]``."""
    import os
    import stat
    import tempfile

    reply = nb.run("%%distributed\nimport warnings\nwarnings.warn('careful with the shards')")
    assert reply.status == "ok", reply.text
    stderr = "".join(m["content"]["text"] for m in reply.outputs
                     if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")
    warned = [line for line in stderr.splitlines() if "UserWarning: careful with the shards" in line]
    assert len(warned) == 1 and warned[0].startswith("[ranks 0-1] "), stderr
    folder = os.path.join(tempfile.gettempdir(), f"clorch_cells_{os.getuid()}")
    assert re.fullmatch(rf"\[ranks 0-1\] {re.escape(folder)}/\d+\.py:2: UserWarning: careful with the shards",
                        warned[0]), warned
    found = os.lstat(folder)
    assert stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and stat.S_IMODE(found.st_mode) == 0o700
    failed = nb.run("%%distributed\nx = rank\nraise ValueError(f'bad {x}')")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", failed.text)
    assert f"Cell In[{failed.execution_count}], line 2" in plain and "clorch_cells_" not in plain, plain


def test_kernel_a_slow_ranks_copy_does_not_hold_the_fast_ranks_line(nb: Any) -> None:
    """Rank 1 prints the same line 4 s after rank 0: rank 0's copy is shown long before that,
    labelled as its own, and rank 1's when it comes (correct, only not merged)."""
    t0 = time.monotonic()
    msg_id = nb.send("%%distributed\nimport time\nif rank == 1:\n    time.sleep(4)\n"
                     "print('checkpoint saved', flush=True)\nif rank == 0:\n    time.sleep(4)")
    nb.wait_for_output(msg_id, "[rank 0] checkpoint saved", timeout=30)
    shown_after = time.monotonic() - t0
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "ok", reply.text
    assert shown_after < 3.0, f"rank 0's line took {shown_after:.1f} s to show"  # rank 1 prints at 4 s
    assert "[rank 1] checkpoint saved" in stdout_of(reply) and "[ranks" not in stdout_of(reply)


def test_kernel_a_warning_before_a_print_stays_before_it(nb: Any) -> None:
    """A rank's stderr and stdout each went out on their own timer, and a cell's end flushed
    stdout first: a warning (or a log line) written before a print showed after it on every rank,
    in every such cell. Ten cells, each rank's lines in the order it wrote them."""
    for _ in range(10):
        reply = nb.run("%%distributed\nimport sys\nsys.stderr.write(f'first {rank}\\n')\nprint(f'second {rank}')\n"
                       "sys.stderr.write(f'third {rank}\\n')")
        assert reply.status == "ok", reply.text
        for rank in (0, 1):
            mine = [line for line in reply.text.splitlines() if line.startswith(f"[rank {rank}] ")]
            assert mine == [f"[rank {rank}] {word} {rank}" for word in ("first", "second", "third")], reply.text


def test_kernel_dots_printed_on_every_rank_stay_one_line_per_rank(nb: Any) -> None:
    """``print('.', end='', flush=True)`` in a loop, the way people show progress without a bar,
    on both ranks at once: each rank's dots are one line that grows live, never chopped into
    labelled pieces by the other rank's dots."""
    reply = nb.run("%%distributed\nimport time\nfor _ in range(5):\n    print('.', end='', flush=True)\n"
                   "    time.sleep(0.3)\nprint(' done')")
    assert reply.status == "ok", reply.text
    assert "." not in stdout_of(reply), stdout_of(reply)  # no piece of a dotted line in the stream
    finals: dict[str, str] = {}
    for m in reply.outputs:
        display_id = (m["content"].get("transient") or {}).get("display_id", "")
        if m["msg_type"] in ("display_data", "update_display_data") and not display_id.startswith("clorch-held-"):
            finals[display_id] = m["content"]["data"]["text/plain"]
    assert sorted(finals.values()) == ["[rank 0] ..... done", "[rank 1] ..... done"], finals
