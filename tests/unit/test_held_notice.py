"""The cell's output limits on the page, across its ranks, and the one line at the top of the
cell's output saying what they held back (clorch_repl.notebook.held_notice), on the display alone."""

from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl.notebook.display import NotebookDisplay
from clorch_repl.wire.limits import Limits, held_display
from clorch_repl.notebook.held_notice import HeldNotice
from clorch_repl.session.protocol import RankOutput


@pytest.fixture(autouse=True)
def _shell(ip: Any) -> None:
    """publish_display_data needs the shell instance the ip fixture creates."""


def test_three_ranks_share_the_cells_limit_and_the_line_at_the_top_says_what_was_held() -> None:
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=(0, 1, 2), held=HeldNotice(Limits(volume=0, lines=100, rate=0)))
        for i in range(300):
            for rank in (0, 1, 2):
                sink.output(RankOutput(rank, "stream", {"name": "stdout", "text": f"rank {rank} line {i}\n"}))
        sink.output(RankOutput(1, "display_data", {"data": held_display(
            {"rank": 1, "lines": 5000, "chars": 60_000, "late": False}), "metadata": {}}))
        sink.flush(final=True)
    assert cap.stdout.count("\n") == 100  # across the ranks, not 100 each
    first, *rest = cap.outputs
    assert first.data == {"text/plain": ""} and first.transient["display_id"].startswith("clorch-held-")
    last = rest[-1]  # the reserved display, updated in place
    assert last.update and last.transient == first.transient
    text = last.data["text/plain"]
    assert text == "clorch held back 5,800 lines (71 KiB) of this cell's output; all in %clorch logs RANK (0-2)"
    assert len(text) <= 100


def test_a_cell_within_its_limits_shows_no_line() -> None:
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=(0, 1))
        for rank in (0, 1):
            sink.output(RankOutput(rank, "stream", {"name": "stdout", "text": "hello\n"}))
        sink.flush(final=True)
    assert cap.stdout == "[ranks 0-1] hello\n"
    assert [o.data["text/plain"] for o in cap.outputs] == [""]  # only the reserved, empty display
