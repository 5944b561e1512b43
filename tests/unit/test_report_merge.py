"""Reports in one glance (issue 25): ranks whose blocks of a report read the same are shown once,
under one heading, and every report spells a set of ranks one way (``ranks 0,2-3``).

Fast: constructed rank states and outcomes, shaped as a 4-rank gloo hang's interrupt gave them
(ranks 0, 2 and 3 in an all_reduce that rank 1 never called, rank 1 asleep in the cell).
"""

from __future__ import annotations

import re
from typing import Any

from clorch_repl import errors
from clorch_repl.diagnosis import render
from clorch_repl.diagnosis.analyse import RankEvidence, analyse
from clorch_repl.host.rankfiles import report_stack
from clorch_repl.common.rank_sets import merge_blocks, rank_words, ranks_are, ranks_text
from clorch_repl.session.protocol import CellOutcome, RankError, RankOutcome, Status

SITE = "/work/.venv/lib/python3.11/site-packages"


def _stuck_dump(address: str) -> str:
    """A stuck rank's faulthandler dump as the notebook reads it (main thread, cells named)."""
    return (f"Current thread {address} (most recent call first):\n"
            f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
            f'  File "{SITE}/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
            '  File "Cell In[3]", line 6 in <module>\n'
            f'  File "{SITE}/IPython/core/interactiveshell.py", line 3699 in run_code\n'
            f'  File "{SITE}/IPython/core/interactiveshell.py", line 3639 in run_ast_nodes\n'
            f'  File "{SITE}/ipykernel/kernelbase.py", line 405 in dispatch_shell\n')


def _entry(seq: int, op: str, state: str) -> dict[str, Any]:
    return {"process_group": ["0", ""], "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
            "state": state, "input_sizes": [[4]] if op != "barrier" else [], "input_dtypes": ["Float"],
            "time_created_ns": 1_000_000_000 * seq}


def _state(rank: int, waiting: bool) -> RankEvidence:
    entries = [_entry(1, "barrier", "completed")] + ([_entry(2, "all_reduce", "scheduled")] if waiting else [])
    if waiting:
        stack = [{"file": "Cell In[3]", "cell": "Cell In[3]", "line": 6, "function": "<module>",
                  "code": "dist.all_reduce(t)", "library": False},
                 {"file": f"{SITE}/torch/distributed/distributed_c10d.py", "line": 3252, "function": "all_reduce",
                  "code": "work.wait()", "library": True}]
    else:
        stack = [{"file": "Cell In[3]", "cell": "Cell In[3]", "line": 4, "function": "<module>",
                  "code": "time.sleep(3600)", "library": False}]
    answer = {"fr": {"entries": entries, "pg_status": {}}, "stack": stack, "in_cell": True,
              "groups": {"0": {"default": True, "ranks": [0, 1, 2, 3]}}, "now_ns": 10_000_000_000}
    return RankEvidence(rank, answer)


def test_one_spelling_of_a_set_of_ranks() -> None:
    assert ranks_text([3, 0, 2]) == "0,2-3" and ranks_text(range(8)) == "0-7"
    assert rank_words([1]) == "rank 1" and rank_words([0, 2, 3]) == "ranks 0,2-3" and rank_words([]) == "no rank"
    assert ranks_are([2]) == "rank 2 is" and ranks_are([0, 1]) == "ranks 0-1 are"
    assert merge_blocks([(2, "a"), (0, "a"), (1, "b"), (3, "a")]) == [((0, 2, 3), "a"), ((1,), "b")]


def test_stuck_ranks_with_the_same_stack_are_one_block_under_one_heading() -> None:
    """The interrupt of a 4-rank hang printed three copies of one "did not return" block (only the
    thread's address differed); now: one block for ranks 0,2-3, the kernel's frames cut."""
    sleep_tb = ("KeyboardInterrupt Traceback (most recent call last)", "Cell In[3], line 4",
                "----> 4     time.sleep(3600)", "KeyboardInterrupt: ")
    ranks = {r: RankOutcome(r, Status.STUCK, stack=_stuck_dump(f"0x00007fcd2ad3{r}b80")) for r in (0, 2, 3)}
    ranks[1] = RankOutcome(1, Status.INTERRUPTED, RankError(1, "KeyboardInterrupt", "", sleep_tb))
    states = [_state(r, waiting=r != 1) for r in range(4)]
    verdict = analyse(states)
    outcome = CellOutcome(ranks=dict(sorted(ranks.items())), interrupted=True, interrupt_grace_s=5.0,
                          diagnosis=render.report(verdict, states))
    err = errors.DistributedCellError(outcome)
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err._render_traceback_()))

    assert verdict.sentence == ("all_reduce #2 (float32[4], default group): ranks 0,2-3 wait in it; "
                                "rank 1 never called it and is at Cell In[3], line 4 in <module>")
    headings = [line for line in text.splitlines() if line.startswith("---- ")]
    # the evidence (ranks 0,2-3 alike, then rank 1), then the failures: ranks 0,2-3 stuck, rank 1 interrupted
    assert headings == ["---- ranks 0,2-3 ----", "---- rank 1 ----", "---- ranks 0,2-3 ----", "---- rank 1 ----"]
    assert text.count("ranks 0,2-3 did not return") == 1 and "an interrupt does not reach" in text
    # the evidence shows where they are (issue 38: their stacks were shown twice, once with full paths)
    assert 'File "Cell In[3]"' not in text and "Where they are now" not in text
    assert "Ranks 0,2-3 are still running this cell" in text
    assert "%clorch interrupt" not in text  # the advice that could not work (issue 38)
    assert "ranks 0, 2" not in text  # the old spelling nowhere
    assert str(err).startswith("ranks 0,2-3 did not return after the interrupt; rank 1 interrupted; why: ")

    # Different stacks stay apart; --no-merge keeps every rank's block.
    ranks[3] = RankOutcome(3, Status.STUCK, stack=_stuck_dump("0x1").replace("line 6", "line 9"))
    apart = "\n".join(errors.DistributedCellError(CellOutcome(ranks=ranks, interrupted=True))._render_traceback_())
    assert "ranks 0,2 did not return" in apart and "rank 3 did not return" in apart
    # with no evidence, the stuck ranks' own stacks: once per distinct stack, kernel frames cut
    assert apart.count('File "Cell In[3]", line 6 in <module>') == 1  # one stack for ranks 0,2
    assert "Current thread (most recent call first):" in apart and "0x00007f" not in apart
    assert "... (the kernel's own frames)" in apart and "dispatch_shell" not in apart and "run_ast_nodes" not in apart
    one_each = "\n".join(errors.DistributedCellError(outcome, merge=False)._render_traceback_())
    assert all(f"rank {r} did not return" in one_each for r in (0, 2, 3))


def test_evidence_of_ranks_on_different_hosts_is_not_merged() -> None:
    states = [_state(r, waiting=True) for r in range(3)]
    states[2].host = "hostB"
    lines = render.evidence(states)
    assert [line for line in lines if line.startswith("----")] == ["---- ranks 0-1 ----", "---- rank 2 on hostB ----"]


def test_a_stack_is_compared_without_thread_addresses() -> None:
    assert report_stack(_stuck_dump("0x00007f01")) == report_stack(_stuck_dump("0x00007f02"))
    assert report_stack(_stuck_dump("0x1"))[-1] == "  ... (the kernel's own frames)"
