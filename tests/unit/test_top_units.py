"""``%clorch top``: what a row shows, from hand-made snapshots. The live panel:
tests/integration/test_top.py."""

from __future__ import annotations

from clorch_repl.session.panel_view import Collective, RankSnapshot, render, rows


def test_rows_say_what_each_rank_does() -> None:
    snaps = [
        RankSnapshot(rank=1, host="hostB", alive=True, busy=True, cell="[7] train(model)", cell_for_s=75,
                     last_line="step 10 loss 0.5", usage={"cpu_pct": 98.0, "rss": 3 * 2 ** 30,
                                                           "gpu": {"util_pct": 87, "memory_used": 40 * 2 ** 30,
                                                                   "memory_total": 141 * 2 ** 30}},
                     collective=Collective("nccl/0", 412, "allreduce", 12.0)),
        RankSnapshot(rank=0, host="", alive=True, busy=True, cell="[7] train(model)", cell_for_s=75, answered=False),
        RankSnapshot(rank=2, host="", alive=False, busy=False,
                     exit="killed by signal SIGKILL (out of memory? the OOM killer sends SIGKILL)"),
    ]
    got = rows(snaps)
    assert [r[0] for r in got] == ["0", "1", "2"]
    assert got[0][2] == "busy, not answering" and got[0][6] == "-"
    assert got[1][1:] == ["hostB", "busy", "[7] train(model)", "1m15s", "step 10 loss 0.5", "98 %", "3.0 GiB",
                          "87 %", "40.0 GiB / 141.0 GiB", "allreduce #412, group 0, for 12s STUCK"]
    assert got[2][2] == "dead (killed by signal SIGKILL)"  # (the death report gives the OOM hint, not the table)
    bundle = render(snaps, verdict="rank 0 never called allreduce #412 of the default group", note="closed")
    assert "hang: rank 0 never called allreduce" in bundle["text/plain"] and "(closed)" in bundle["text/plain"]
    assert "<table>" in bundle["text/html"] and "STUCK" in bundle["text/html"]


def test_every_column_is_explained_and_a_row_reads_as_a_user_would_see_it() -> None:
    """Issue 38: colour codes and carriage returns of the last line gone; the cell column shows the
    line the rank is at now where its stack says; each column explained (a tooltip in HTML, a
    legend under the text table)."""
    snap = RankSnapshot(rank=0, host="", alive=True, busy=True, cell="[3] import time", cell_for_s=12,
                        last_line="\x1b[31mKeyboardInterrupt\x1b[0m", line_now="line 6: dist.barrier()")
    bar = RankSnapshot(rank=1, host="", alive=True, busy=False, last_line="  5%|5  \r100%|##########| 40/40\r")
    got = rows([snap, bar])
    assert got[0][3] == "[3] line 6: dist.barrier()" and got[0][4] == "12s"
    assert got[0][5] == "KeyboardInterrupt" and got[1][5] == "100%|##########| 40/40"
    bundle = render([snap, bar])
    assert "\x1b" not in bundle["text/plain"] and "\x1b" not in bundle["text/html"]
    for column in ("host", "cell", "collective"):
        assert f"  {column}: " in bundle["text/plain"] and "title='" in bundle["text/html"]
    assert "here: the notebook's own" in bundle["text/plain"] and "group 0 is the default group" in bundle["text/plain"]


def test_a_rank_stuck_in_a_cell_keeps_that_cell_after_its_wait_ended() -> None:
    from clorch_repl.session.cell_labels import RankCells

    cells = RankCells()
    label, ranks, at = cells.sent("[4] import time", (0, 1, 2))
    assert (label, ranks) == ("[4] import time", (0, 1, 2))
    cells.sent("[5] print('only rank 2')", (2,))
    assert cells.of(0, busy=[0, 1]) == ("[4] import time", at)  # still busy with cell 4
    assert cells.of(2, busy=[0, 1]) is None  # idle: no cell
