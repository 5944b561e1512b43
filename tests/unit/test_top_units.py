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
        RankSnapshot(rank=2, host="", alive=False, busy=False, exit="killed by signal SIGKILL"),
    ]
    got = rows(snaps)
    assert [r[0] for r in got] == ["0", "1", "2"]
    assert got[0][2] == "busy, not answering" and got[0][6] == "-"
    assert got[1][1:] == ["hostB", "busy", "[7] train(model)", "1m15s", "step 10 loss 0.5", "98 %", "3.0 GiB",
                          "87 %", "40.0 GiB / 141.0 GiB", "allreduce #412 (nccl/0) for 12s STUCK"]
    assert got[2][2] == "dead (killed by signal SIGKILL)"
    bundle = render(snaps, verdict="rank 0 never called allreduce #412 of the default group", note="closed")
    assert "hang: rank 0 never called allreduce" in bundle["text/plain"] and "(closed)" in bundle["text/plain"]
    assert "<table>" in bundle["text/html"] and "STUCK" in bundle["text/html"]
