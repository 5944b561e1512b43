"""Whether the ranks' collectives still line up after a failed cell (diagnosis.entries.out_of_step),
from light answers as ranks send them (the flight recorder's group status, as JSON gives it)."""

from __future__ import annotations

from typing import Any

from clorch_repl.diagnosis.entries import out_of_step


def light(**groups: int) -> dict[str, Any]:
    """A rank's light answer: per group key ("fr/0"), its last enqueued (= completed) collective."""
    return {"fr": {"pg_status": {key.replace("_", "/"): {"last_enqueued_collective": n, "last_completed_collective": n,
                                                         "last_started_collective": -1}
                                 for key, n in groups.items()}}, "stack": []}


def test_ranks_that_called_as_many_collectives_are_in_step() -> None:
    assert out_of_step({0: light(fr_0=4, fr_1=2), 1: light(fr_0=4, fr_1=2)}) is None
    assert out_of_step({}) is None


def test_a_rank_further_on_than_another_is_named_with_the_group() -> None:
    """Rank 0's all_reduce timed out (gloo's own timeout) while rank 1 never called it."""
    why = out_of_step({0: light(fr_0=4, fr_1=1), 1: light(fr_0=2, fr_1=1)})
    assert why == "the ranks' collectives on the default group no longer line up (called so far: rank 0 4, rank 1 2)"
    sub = out_of_step({0: light(fr_0=2, fr_3=5), 1: light(fr_0=2, fr_3=4), 2: light(fr_0=2)})
    assert sub is not None and "on group 3" in sub and "rank 2" not in sub  # rank 2 is no member of it


def test_ranks_that_did_not_answer_or_have_no_recorder_say_nothing() -> None:
    assert out_of_step({0: light(fr_0=4), 1: None}) is None
    assert out_of_step({0: light(fr_0=4), 1: {"error": "RuntimeError: no"}}) is None
    assert out_of_step({0: {"fr": None, "fr_missing": "off"}, 1: light(fr_0=2)}) is None
