"""Lost is final for a session (clorch_repl.launchers.liveness): the verdict, and what a nanny that
comes back after it is told."""

from __future__ import annotations

from clorch_repl.launchers.liveness import LOST_EXIT_CODE, answer_to_lost, is_lost


def test_a_rank_is_lost_once_silent_too_long_and_stays_lost() -> None:
    # recorded silences of hostB's nanny: heard, cut (silence grows), link back (heard again)
    declared = False
    verdicts = []
    for silent in (0.2, 1.1, 3.0, 5.2, 6.0, 0.1, 0.3):
        declared = is_lost(declared, silent, lost_after_s=5.0)
        verdicts.append(declared)
    assert verdicts == [False, False, False, True, True, True, True]


def test_a_nanny_that_comes_back_is_told_to_end_and_why() -> None:
    for op in ("hb", "reply", "kernel"):
        answer = answer_to_lost(1, "hostB", op, 6.0)
        assert answer is not None and answer["op"] == "exit" and answer["code"] == LOST_EXIT_CODE
        assert "rank 1 on hostB lost after 6 s" in answer["why"] and "%clorch restart" in answer["why"]
    assert answer_to_lost(1, "hostB", "exited", 6.0) is None  # it is ending already
