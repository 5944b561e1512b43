"""Three defects a try-out found in the hang and death diagnosis, on recorded entries, no processes:

1. every ``dist.scatter`` (and gather, scatter_object_list, gather_object, clorch's own
   load_checkpoint) was said to be a mismatch ("rank 0 passed float32[2, 2], rank 1 passed no
   tensor") where torch is not imported in the notebook: only a scatter's source passes its list,
   only a gather's destination receives one;
2. a rank whose cell raised while another waited in a collective was "never called it and is not
   running a cell", the error itself found only below every rank's evidence;
3. a rank's evidence could show a heading with nothing under it ("stack (most recent call last):").

The answers in ``recorded/gloo-rooted-*.json`` were recorded from 3 real gloo ranks (torch 2.13,
the probe's own answer, frames dropped) after a barrier, scatter, gather, reduce, broadcast,
scatter_object_list, gather_object (objects of different sizes), all_gather_object and
broadcast_object_list. The same on real sessions: tests/integration/test_diagnosis_tryout.py.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

from clorch_repl.diagnosis import render
from clorch_repl.diagnosis.analyse import RankEvidence, analyse
from clorch_repl.session.protocol import Status

from test_cell_run import Cell, iopub, reply
from clorch_repl.session.ledger import Ledger

RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded")


def recorded_rooted() -> list[dict[str, Any]]:
    """The three ranks' recorded answers (fresh copies: tests change them)."""
    answers = []
    for rank in range(3):
        with open(os.path.join(RECORDED, f"gloo-rooted-{rank}.json")) as fh:
            answers.append(json.load(fh))
    return answers


@pytest.fixture(params=["notebook without torch", "notebook with torch"])
def comparison(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the ranks' calls are compared: ours (the notebook has not imported torch, as
    usual) and torch's own ``Op.match`` (it has)."""
    if request.param == "notebook without torch":
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    else:
        pytest.importorskip("torch.distributed.flight_recorder.components.types")
    return str(request.param)


def _entry(answer: dict[str, Any], seq: int) -> dict[str, Any]:
    return next(e for e in answer["fr"]["entries"] if e["collective_seq_id"] == seq)


# ------------------------------------------------------------------ 1. rooted collectives
def test_rooted_collectives_of_a_healthy_session_are_no_mismatch(comparison: str) -> None:
    answers = recorded_rooted()
    assert _entry(answers[1], 2)["input_sizes"] == [] and _entry(answers[1], 3)["output_sizes"] == []  # as recorded
    verdict = analyse([RankEvidence(r, answer=a) for r, a in enumerate(answers)])
    assert not verdict.mismatch and not verdict.hang, verdict.sentence
    assert verdict.sentence == "no collective is pending: ranks 0-2 are not running a cell", verdict.sentence


def test_receivers_of_a_scatter_that_differ_are_still_a_mismatch(comparison: str) -> None:
    answers = recorded_rooted()
    scatter = _entry(answers[2], 2)
    scatter["output_sizes"] = [[3]]
    verdict = analyse([RankEvidence(r, answer=a) for r, a in enumerate(answers)])
    assert verdict.mismatch and verdict.seq == 2, verdict.sentence
    assert verdict.sentence == ("scatter #2 (float32[3, 2], default group): ranks 0-1 passed float32[2], "
                                "rank 2 passed float32[3]"), verdict.sentence


def test_senders_of_a_gather_that_differ_are_still_a_mismatch(comparison: str) -> None:
    answers = recorded_rooted()
    _entry(answers[2], 3)["input_sizes"] = [[4]]
    verdict = analyse([RankEvidence(r, answer=a) for r, a in enumerate(answers)])
    assert verdict.mismatch and verdict.seq == 3, verdict.sentence
    assert verdict.sentence == ("gather #3 (float32[3], default group): ranks 0-1 passed float32[3], "
                                "rank 2 passed float32[4]"), verdict.sentence


# ------------------------------------------------------------------ 2. a rank that raised
def _one_waits_in_a_barrier() -> list[RankEvidence]:
    """Rank 0 waits in barrier #2; rank 1 is back at its prompt (its cell raised)."""
    def answer(rank: int, entries: list[dict[str, Any]], in_cell: bool) -> dict[str, Any]:
        return {"fr": {"entries": entries, "pg_status": {"fr/0": {"last_completed_collective": 1}}},
                "groups": {"0": {"ranks": [0, 1], "default": True}}, "in_cell": in_cell, "now_ns": 10**10,
                "stack": [{"file": "/tmp/ipykernel_1/3.py", "line": 3, "function": "<module>",
                           "code": "dist.barrier()", "cell": "Cell In[3]", "library": False}] if in_cell else []}

    def barrier(seq: int) -> dict[str, Any]:
        return {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq, "op_id": seq,
                "p2p_seq_id": 0, "profiling_name": "gloo:barrier", "input_sizes": [], "input_dtypes": [],
                "output_sizes": [], "output_dtypes": [], "state": "scheduled", "retired": seq == 1,
                "is_p2p": False, "time_created_ns": seq, "recorder": "fr"}
    return [RankEvidence(0, answer=answer(0, [barrier(1), barrier(2)], True)),
            RankEvidence(1, answer=answer(1, [barrier(1)], False))]


def test_a_rank_that_raised_is_named_with_its_error_in_the_verdict() -> None:
    states = _one_waits_in_a_barrier()
    text = render.report(analyse(states), states)
    assert text.startswith("barrier #2 (default group): rank 0 waits in it; rank 1 never called it and is not "
                           "running a cell\n")  # what the probe alone can say
    weighed = render.with_raised(states, {1: ("RuntimeError", "data file missing on rank 1\nmore lines")})
    first, *rest = render.report(analyse(weighed), weighed).splitlines()
    assert first == ("barrier #2 (default group): rank 0 waits in it; rank 1 raised RuntimeError "
                     "(data file missing on rank 1 ...) before calling it"), first
    assert rest == text.splitlines()[1:]  # the rest of the report as it was


def test_a_failed_cells_run_says_what_its_ranks_raised() -> None:
    cell = Cell(Ledger())
    cell.iopub(1, iopub("error", "c-1", {"ename": "RuntimeError", "evalue": "data file missing on rank 1",
                                         "traceback": ["tb"]}), 1.0)
    cell.reply(1, reply("c-1", 1, status="error", ename="RuntimeError"), 1.1)
    assert cell.run.outcome.ranks[1].status is Status.ERROR
    assert cell.run.next_command(1.0 + 2.0).diagnose  # (the relay then asks the ranks, with what they raised)
    assert cell.run.raised() == {1: ("RuntimeError", "data file missing on rank 1")}


# ------------------------------------------------------------------ 3. no empty heading
@pytest.mark.parametrize("stack, why", [
    ([], "  stack: no frame of its cell's code"),
    ([{"file": "/site/clorch_repl/kernel/output.py", "line": 9, "function": "write", "own": True,
       "library": True}], "  stack: only clorch_repl's own frames (not shown)")])
def test_a_rank_whose_stack_shows_nothing_says_why(stack: list[dict[str, Any]], why: str) -> None:
    states = _one_waits_in_a_barrier()
    states[0].answer["stack"] = stack
    lines = render.report(analyse(states), states).splitlines()
    block = lines[lines.index("---- rank 0 ----") + 1:lines.index("---- rank 1 ----")]
    assert any(line.startswith(why) for line in block), block
    for heading, following in zip(block, block[1:] + ["---- end"]):
        assert not heading.endswith(":") or following.startswith("    "), block  # never an empty heading

