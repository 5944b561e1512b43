"""The analysis on answers recorded from real gloo ranks (tests/hang_scenarios.py): each scenario
runs 2 or 3 real processes in a real gloo group, each probed by a thread while its main thread is
blocked, and the verdict must name the op, its sequence number, the ranks and the line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from clorch_repl.diagnosis import render
from clorch_repl.diagnosis.analyse import RankState, analyse
from clorch_repl.procs import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def record(name: str, world: int, tmp_path: Any) -> list[RankState]:
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    outs = [str(tmp_path / f"{name}-{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "hang_scenarios.py"), name, str(r),
                               str(world), port, outs[r]], env=env) for r in range(world)]
    try:
        for p in procs:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    states = []
    for r, path in enumerate(outs):
        with open(path) as fh:
            states.append(RankState(r, answer=json.load(fh)))
    return states


def test_a_rank_that_skips_an_all_reduce_is_named_with_its_line(tmp_path: Any) -> None:
    states = record("skip", 3, tmp_path)
    verdict = analyse(states)
    assert verdict.hang and verdict.op == "all_reduce" and verdict.seq == 3
    assert verdict.waiting == [0, 2] and verdict.missing == [1]
    assert verdict.sentence.startswith("all_reduce #3 (float32[1024], default group): ranks 0, 2 wait in it; "
                                       "rank 1 never called it and is at ")
    assert "hang_scenarios.py:" in verdict.sentence and "in load_batch()" in verdict.sentence
    assert verdict.pending_s is not None and verdict.pending_s >= 1.0
    text = render.report(verdict, states)
    assert "all_reduce #3 (float32[1024]) group 0: scheduled" in text  # rank 0's pending entry
    assert "all_reduce #2 (float32[1024]) group 0: completed" in text
    assert "time.sleep(4)" in text  # rank 1's stack shows the line


def test_an_op_mismatch_names_both_ops_and_the_earlier_size_mismatch(tmp_path: Any) -> None:
    verdict = analyse(record("mismatch", 2, tmp_path))
    # gloo completes a broadcast of unequal sizes (#3) and hangs in all_reduce vs broadcast (#4).
    assert verdict.hang and verdict.mismatch and verdict.seq == 4
    assert verdict.sentence == ("collective #4 (default group): rank 0 called all_reduce(float32[4]), "
                                "rank 1 called broadcast(float32[4]); ranks 0, 1 wait in it; earlier, "
                                "broadcast #3 (float32[4], default group): rank 0 has float32[4], "
                                "rank 1 has float32[8]")


def test_a_subgroup_is_named_with_its_members_and_outsiders_are_not_blamed(tmp_path: Any) -> None:
    verdict = analyse(record("subgroup", 3, tmp_path))
    assert verdict.hang and verdict.missing == [1]  # rank 2 is not in the group: not "missing"
    assert re.fullmatch(r"all_reduce #1 \(float32\[2\], group 1 of ranks 0, 1\): rank 0 waits in it; "
                        r"rank 1 never called it and is at \S*hang_scenarios\.py:\d+ in load_batch\(\)",
                        verdict.sentence), verdict.sentence


def test_computing_ranks_are_not_a_hang(tmp_path: Any) -> None:
    verdict = analyse(record("compute", 2, tmp_path))
    assert not verdict.hang
    assert verdict.sentence.startswith("no collective is pending")
    assert "rank 0 is at " in verdict.sentence and "rank 1 is at " in verdict.sentence


def test_a_dead_rank_is_named() -> None:
    # Rank 1's answer is absent because it died: built from a recorded answer of rank 0 alone.
    pytest.importorskip("torch")
    states = [RankState(0, answer={"fr": {"entries": [
        {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 2,
         "p2p_seq_id": 0, "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"],
         "output_sizes": [[4]], "output_dtypes": ["Float"], "state": "scheduled", "retired": False,
         "is_p2p": False, "time_created_ns": 0}],
        "pg_status": {"0": {"last_completed_collective": 1}}},
        "groups": {"0": {"ranks": [0, 1], "default": True}}, "stack": [], "in_cell": True, "now_ns": 10**10}),
        RankState(1, dead="exit code 3")]
    verdict = analyse(states)
    assert verdict.sentence == ("all_reduce #2 (float32[4], default group): rank 0 waits in it; "
                                "rank 1 died (exit code 3)")
