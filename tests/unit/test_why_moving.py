"""``%clorch why`` on a busy, healthy group (clorch_repl.diagnosis.moving): a look at ranks whose
thread runs collectives all the time always finds one pending, and read alone it said "ranks 0-1
wait in it", or, catching one rank between two calls, "rank 0 never called it" (a try-out). A
second, light look decides. Recorded group statuses, no process."""

from __future__ import annotations

from clorch_repl.diagnosis.entries import CollectiveProgress, Verdict
from clorch_repl.diagnosis.moving import moved_on, moving_verdict


def _at(enqueued: int, completed: int) -> CollectiveProgress:
    return CollectiveProgress((("fr/0", enqueued, completed),), calling=False)


def test_collectives_that_moved_on_between_two_looks_are_no_hang() -> None:
    first = {0: _at(829, 828), 1: _at(829, 828)}
    assert moved_on(first, {0: _at(1107, 1106), 1: _at(1108, 1107)})
    verdict = Verdict("all_reduce #829 (float32[10], default group): rank 1 waits in it; rank 0 never called it "
                      "and is not running a cell", hang=True, op="all_reduce", seq=829, waiting=[1], missing=[0])
    said = moving_verdict(verdict, [0, 1])
    assert not said.hang and not said.stuck and said.missing == []
    assert "rank 1 completed more collectives" in moving_verdict(verdict, [1]).sentence
    assert "which caught it in one" in moving_verdict(verdict, [1]).sentence
    assert said.sentence.startswith("no collective is stuck: ranks 0-1 completed more collectives in the 0.3 s "
                                    "after the look below, which caught them in one (all_reduce #829"), said.sentence


def test_a_rank_that_stood_still_or_did_not_answer_keeps_the_hang() -> None:
    first = {0: _at(5, 4), 1: _at(5, 4)}
    assert not moved_on(first, {0: _at(9, 8), 1: _at(5, 4)})  # rank 1 is still in #5
    assert not moved_on(first, {0: _at(9, 8), 1: None})  # rank 1 did not answer the second look
    assert not moved_on({}, {})  # nothing was pending: nothing to say


def test_calls_that_differ_keep_their_verdict_though_they_complete() -> None:
    """NCCL ranks that call all_reduce against broadcast may complete, with wrong data: the first
    look's mismatch stays the verdict (``AsksRanks.why`` makes no second look for it)."""
    from clorch_repl.session.rank_questions import AsksRanks

    class Asks(AsksRanks):
        def __init__(self) -> None:
            self.asked_again = False

        def diagnose(self, ranks=None, **_):  # type: ignore[no-untyped-def]
            from clorch_repl.diagnosis.entries import RankEvidence
            return (Verdict("collective #2: rank 0 called all_reduce(float32[4]), rank 1 called broadcast(float32[4])",
                            hang=True, mismatch=True), [RankEvidence(0, answer={"fr": {"pg_status": {"0": {
                                "last_enqueued_collective": 2, "last_completed_collective": 1}}}})])

    asks = Asks()
    asks._prober = None  # type: ignore[assignment]  # (a second look would call it and fail)
    assert asks.why().startswith("collective #2: rank 0 called all_reduce")
