"""The analysis on answers recorded from real gloo ranks (tests/hang_scenarios.py): each scenario
runs 2 or 3 real processes in a real gloo group, each probed by a thread while its main thread is
blocked, and the verdict must name the op, its sequence number, the ranks and the line. On
hand-written and recorded NCCL answers, without processes: tests/unit/test_hang_analysis.py."""

from __future__ import annotations

import re
from typing import Any

import hang_scenarios
from clorch_repl.diagnosis import render
from clorch_repl.diagnosis.analyse import analyse


def test_a_rank_that_skips_an_all_reduce_is_named_with_its_line(tmp_path: Any) -> None:
    states = hang_scenarios.record("skip", 3, str(tmp_path))
    verdict = analyse(states)
    assert verdict.hang and verdict.op == "all_reduce" and verdict.seq == 3
    assert verdict.waiting == [0, 2] and verdict.missing == [1]
    assert verdict.sentence.startswith("all_reduce #3 (float32[1024], default group): ranks 0,2 wait in it; "
                                       "rank 1 never called it and is at ")
    assert "hang_scenarios.py:" in verdict.sentence and "in load_batch()" in verdict.sentence
    assert verdict.pending_s is not None and verdict.pending_s >= 1.0
    text = render.report(verdict, states)
    assert "all_reduce #3 (float32[1024]) group 0: scheduled" in text  # rank 0's pending entry
    assert "all_reduce #2 (float32[1024]) group 0: completed" in text
    assert "time.sleep(4)" in text  # rank 1's stack shows the line


def test_ranks_on_other_hosts_are_named_with_their_host(tmp_path: Any) -> None:
    states = hang_scenarios.record("skip", 2, str(tmp_path))
    for state, host in zip(states, ("hostA", "hostB")):
        state.host = host  # as the relay fills it in for a session that spans hosts
    verdict = analyse(states)
    assert verdict.sentence.startswith("all_reduce #3 (float32[1024], default group): rank 0 waits in it; "
                                       "rank 1 on hostB never called it and is at "), verdict.sentence
    text = render.report(verdict, states)
    assert "---- rank 0 on hostA ----" in text and "---- rank 1 on hostB ----" in text


def test_an_op_mismatch_names_both_ops_and_the_earlier_size_mismatch(tmp_path: Any) -> None:
    verdict = analyse(hang_scenarios.record("mismatch", 2, str(tmp_path)))
    # gloo completes a broadcast of unequal sizes (#3) and hangs in all_reduce vs broadcast (#4).
    assert verdict.hang and verdict.mismatch and verdict.seq == 4
    assert verdict.sentence == ("collective #4 (default group): rank 0 called all_reduce(float32[4]), "
                                "rank 1 called broadcast(float32[4]); ranks 0-1 wait in it; earlier, "
                                "broadcast #3 (float32[4], default group): rank 0 has float32[4], "
                                "rank 1 has float32[8]")


def test_a_subgroup_is_named_with_its_members_and_outsiders_are_not_blamed(tmp_path: Any) -> None:
    verdict = analyse(hang_scenarios.record("subgroup", 3, str(tmp_path)))
    assert verdict.hang and verdict.missing == [1]  # rank 2 is not in the group: not "missing"
    assert re.fullmatch(r"all_reduce #1 \(float32\[2\], group 1 of ranks 0-1\): rank 0 waits in it; "
                        r"rank 1 never called it and is at \S*hang_scenarios\.py:\d+ in load_batch\(\)",
                        verdict.sentence), verdict.sentence


def test_a_pending_collective_pushed_out_of_the_recorder_is_still_named(tmp_path: Any) -> None:
    # Rank 0 waits in all_reduce #3 while a thread on each rank runs 100 collectives of a second
    # group through a recorder of 32 entries: every entry of the default group is gone; its
    # status still counts the pending one. (Before: "no collective is pending: rank 0 is at ...
    # inside all_reduce()".) Which group it is cannot be read back, so no rank is blamed.
    states = hang_scenarios.record("evicted", 2, str(tmp_path), env={"TORCH_FR_BUFFER_SIZE": "32"})
    assert not any(e["pg_id"] == 0 for e in states[0].answer["fr"]["entries"])
    verdict = analyse(states)
    assert verdict.hang and not verdict.stuck and verdict.waiting == [0] and verdict.missing == []
    assert re.fullmatch(r"rank 0 waits in an operation whose entries torch's flight recorder no longer holds: later "
                        r"entries pushed out every entry of its group \(fr/0; TORCH_FR_BUFFER_SIZE=32 on rank 0, a "
                        r"larger one keeps more\); rank 1 is at \S*hang_scenarios\.py:\d+ in load_batch\(\)",
                        verdict.sentence), verdict.sentence
    assert verdict.pending_s is not None and verdict.pending_s >= 1.0  # at least as old as the oldest entry kept
    text = render.report(verdict, states)
    assert re.search(r"fr/0: operation \d+ \(its group's own count\) pending, every entry of the group gone", text), text


def test_sends_before_a_skipped_collective_do_not_hide_it(tmp_path: Any) -> None:
    # gloo's group status numbers sends and receives with the collectives: after two sends,
    # all_reduce #3 is the group's operation 5 and #4 operation 6. Compared with the collective
    # number, a status that completed operation 5 read #4 as completed too ("no collective is
    # pending").
    verdict = analyse(hang_scenarios.record("p2p_skip", 2, str(tmp_path)))
    assert verdict.stuck and verdict.op == "all_reduce" and verdict.seq == 4, verdict.sentence
    assert verdict.sentence.startswith("all_reduce #4 (float32[1024], default group): rank 0 waits in it; "
                                       "rank 1 never called it and is at "), verdict.sentence
    assert "gone from torch's flight recorder" not in verdict.sentence


def test_computing_ranks_are_not_a_hang(tmp_path: Any) -> None:
    verdict = analyse(hang_scenarios.record("compute", 2, str(tmp_path)))
    assert not verdict.hang
    assert verdict.sentence.startswith("no collective is pending")
    # Both ranks at the same line are one clause (ranks 0-1 are at ...), else one each.
    sentence = verdict.sentence
    assert "ranks 0-1 are at " in sentence or ("rank 0 is at " in sentence and "rank 1 is at " in sentence), sentence


def test_a_mismatch_of_three_ranks_names_every_ranks_call(tmp_path: Any) -> None:
    # Rank 0 broadcasts, ranks 1 and 2 all_reduce (#3): before, rank 2's call was never mentioned.
    verdict = analyse(hang_scenarios.record("mismatch3", 3, str(tmp_path)))
    assert verdict.hang and verdict.mismatch and verdict.seq == 3
    assert verdict.sentence == ("collective #3 (default group): rank 0 called broadcast(float32[4]), "
                                "ranks 1-2 called all_reduce(float32[4]); ranks 0-2 wait in it"), verdict.sentence
