"""The collective a rank's death may have ended reads the same in the cell's death report and in
``%clorch why`` afterwards: "ended, perhaps failed (rank 1 of its group died)", never "completed".

Fast: recorded answers shaped as a gloo survivor gives them after its all_reduce failed on the
peer's death (torch 2.13: retired, state "scheduled", the group's status counting it completed).
On real ranks: tests/integration/test_why_after_death.py.
"""

from __future__ import annotations

from typing import Any

from clorch_repl.diagnosis import render
from clorch_repl.diagnosis.analyse import RankEvidence, analyse
from clorch_repl.diagnosis.deaths import DeathsSeen

S = 10**9
DOUBTED = "    all_reduce #2 (float32[8]) group 0: ended, perhaps failed (rank 1 of its group died)"
COMPLETED = "    all_reduce #2 (float32[8]) group 0: completed"
LAST = "rank 1 died (exit code 3); the last collective of ranks 0,2 was all_reduce #2 (float32[8], default group)"


def _entry(seq: int, op: str, created_s: int) -> dict[str, Any]:
    """One gloo entry of the default group as the recorder keeps a collective that ended."""
    sizes = [[8]] if op != "barrier" else []
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": sizes,
            "input_dtypes": ["Float"] * len(sizes), "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes),
            "state": "scheduled", "retired": True, "is_p2p": False, "time_created_ns": created_s * S}


def _survivor(rank: int, cell_began_s: int) -> RankEvidence:
    """A rank idle after its all_reduce (#2, called at 20 s) failed; its latest cell began then."""
    entries = [_entry(1, "barrier", 1), _entry(2, "all_reduce", 20)]
    answer = {"fr": {"entries": entries, "pg_status": {"0": {"last_enqueued_collective": 2,
                                                             "last_completed_collective": 2}}},
              "groups": {"0": {"ranks": [0, 1, 2], "default": True}}, "stack": [], "in_cell": False,
              "now_ns": 100 * S, "cell_began_ns": cell_began_s * S}
    return RankEvidence(rank, answer=answer)


def _looks(cell_began_s: int, seen: DeathsSeen) -> list[RankEvidence]:
    """Every rank's evidence as one look finds it: ranks 0 and 2 in a cell begun at ``cell_began_s``,
    rank 1 dead (the same process each time), filled by the notebook's ``seen``."""
    states = [_survivor(0, cell_began_s), RankEvidence(1, dead="exit code 3"), _survivor(2, cell_began_s)]
    seen.fill(states, lambda rank: 1.0)
    return states


def test_the_evidence_of_one_rank_is_weighed_against_its_dead_peer() -> None:
    # %clorch why --rank 0: rank 0's evidence alone is shown, the dead rank 1 still counts
    states = _looks(10, DeathsSeen())
    text = render.report(analyse(states), states, shown=[0]).splitlines()
    assert text[0] == LAST, text
    assert "---- rank 0 ----" in text and "---- rank 1 ----" not in text, text
    assert DOUBTED in text and COMPLETED not in text, text


def test_a_later_cell_does_not_turn_the_death_cells_collective_into_completed() -> None:
    seen = DeathsSeen()
    death = _looks(10, seen)  # the cell's death report: the cell began at 10 s, all_reduce at 20 s
    report = render.report(analyse(death), death).splitlines()
    assert report[0] == LAST and DOUBTED in report, report
    later = _looks(50, seen)  # %clorch why after a cell on the survivors, begun at 50 s
    why = render.report(analyse(later), later).splitlines()
    assert why[0] == report[0] and DOUBTED in why and COMPLETED not in why, why


def test_a_death_first_seen_after_the_collective_ended_leaves_it_completed() -> None:
    # The start-up barrier rule stands: a collective called before the cell the death was first
    # seen in had ended before it began.
    states = _looks(50, DeathsSeen())
    text = render.report(analyse(states), states).splitlines()
    assert text[0] == "rank 1 died (exit code 3); ranks 0,2 had entered no collective in this cell", text
    assert COMPLETED in text, text


def test_a_rank_replaced_and_dead_again_is_a_new_death() -> None:
    seen = DeathsSeen()
    _looks(10, seen)
    states = [_survivor(0, 50), RankEvidence(1, dead="exit code 3"), _survivor(2, 50)]
    seen.fill(states, lambda rank: 2.0)  # another process of rank 1, first seen dead at 50 s
    assert states[1].died_in == {0: 50 * S, 2: 50 * S}
    assert COMPLETED in render.report(analyse(states), states).splitlines()
