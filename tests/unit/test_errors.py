"""The error hierarchy a user catches, the old import paths that still reach it, and the meaning
given to torch's failure messages. Fast: no ranks, no torch for most of it."""

from __future__ import annotations

import pytest

from clorch_repl import errors
from clorch_repl.distributed.failures import looks_like_cascade
from clorch_repl.session.protocol import CellOutcome, RankError, RankOutcome, Status


def test_every_error_but_a_failed_cell_is_a_clorch_error() -> None:
    classes = [getattr(errors, name) for name in errors.__all__]
    outside = [c.__name__ for c in classes if not issubclass(c, errors.ClorchError)]
    assert outside == ["DistributedCellError"]  # the user's own code failing on the ranks
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.SignatureError, ValueError)
    assert issubclass(errors.JobTimeout, TimeoutError) and issubclass(errors.CollectiveTimeout, TimeoutError)
    assert issubclass(errors.CollectiveMismatch, errors.CollectiveError)
    assert errors.RankFailure("rank 1 failed", rank=1).rank == 1
    assert errors.CollectiveMismatch("differs", ranks=(2,)).ranks == (2,)
    assert errors.StartupError("no group").outcome is None


def test_the_api_names_reach_the_same_classes() -> None:
    """API.md's ``dist.X`` names are the classes of clorch_repl.errors, not copies."""
    from clorch_repl import distributed as dist

    assert dist.CollectiveMismatch is errors.CollectiveMismatch and dist.NoProcessGroup is errors.NoProcessGroup


def _failed(rank: int, status: Status, ename: str = "", tb: tuple[str, ...] = ()) -> RankOutcome:
    error = RankError(rank, ename, "boom", tb) if ename else None
    return RankOutcome(rank, status, error, exit="killed by signal SIGKILL" if status is Status.DIED else None)


def test_a_failed_cell_shows_each_rank_once_per_distinct_traceback() -> None:
    tb = ("ValueError: boom", "Cell In[3], line 1")
    outcome = CellOutcome(ranks={0: _failed(0, Status.ERROR, "ValueError", tb),
                                 1: _failed(1, Status.ERROR, "ValueError", tb),
                                 2: _failed(2, Status.DIED)})
    err = errors.DistributedCellError(outcome, merge=True)
    assert str(err) == "ranks 0-1: ValueError: boom; rank 2 died (killed by signal SIGKILL)"
    assert err.failed_ranks == [0, 1, 2]
    text = "\n".join(err._render_traceback_())
    assert text.count("Cell In[3], line 1") == 1 and "---- ranks 0-1 ----" in text
    assert "rank 2 died" in text and "%clorch restart" in text
    separate = "\n".join(errors.DistributedCellError(outcome, merge=False)._render_traceback_())
    assert separate.count("Cell In[3], line 1") == 2


@pytest.mark.parametrize("kind, message, cascade", [
    ("RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5281", True),
    ("DistBackendError", "NCCL communicator was aborted on rank 1", True),
    ("RuntimeError", "Timed out waiting 30000ms for recv operation to complete", True),
    ("CollectiveError", "all_reduce on rank 0 failed because another rank went away", True),
    ("ValueError", "loss is nan at step 12", False),
    ("KeyError", "'epochs'", False),
])
def test_cascade_or_cause(kind: str, message: str, cascade: bool) -> None:
    assert looks_like_cascade(kind, message) is cascade


def test_a_dead_rank_and_a_stuck_one_are_told_apart() -> None:
    """A died rank broke the group (restart); a stuck one is still busy with the cell, maybe in
    code that caught the interrupt: the report says which is which and what to do for each."""
    outcome = CellOutcome(ranks={0: _failed(0, Status.STUCK), 1: _failed(1, Status.DIED)}, timed_out=True,
                          interrupt_grace_s=5.0)
    err = errors.DistributedCellError(outcome, timeout_s=2.0)
    text = "\n".join(err._render_traceback_()).replace("\x1b[31m", "").replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert "Timed out after 2 s; the ranks were interrupted and given 5 s more to return." in text
    flat = " ".join(line.strip() for line in text.splitlines())  # wrapped at the cell's width
    assert "or in code that caught the KeyboardInterrupt and went on" in flat
    # a restart of those ranks alone comes first: it keeps the others' variables
    assert ("The process group is broken: rank 1 died. %clorch restart --ranks 1 starts it afresh and forms the "
            "group again while the others keep their variables; %clorch restart starts every rank afresh.") in flat
    assert ("Rank 0 is still running this cell and takes no other cell. %clorch restart --ranks 0 starts it "
            "afresh") in flat
    assert all(len(line) <= 100 for line in text.splitlines()), text
    two = CellOutcome(ranks={r: _failed(r, Status.DIED) for r in (0, 1, 2, 5)}, timed_out=True)
    flat_two = " ".join(line.strip() for line in errors.DistributedCellError(two, timeout_s=2.0)._render_traceback_())
    assert "The process group is broken: ranks 0-2,5 died. %clorch restart --ranks 0,1,2,5 starts them afresh" in flat_two
    assert str(err).startswith("the cell timed out after 2 s (the ranks were interrupted and given 5 s more to return)")


def test_a_wait_cut_short_says_the_rank_had_not_returned_then_not_that_it_never_did() -> None:
    """A second interrupt ends the wait at once; the session may then abort the group and form it
    again, freeing the rank: the report must not say "did not return" and "every rank kept its
    variables" in one breath (a new user read that as a contradiction)."""
    recovered = "clorch: the group was aborted and formed again in 0.2 s; every rank kept its variables"
    outcome = CellOutcome(ranks={0: _failed(0, Status.STUCK), 1: _failed(1, Status.INTERRUPTED)}, interrupted=True,
                          cut_short=True, group_aborted=True, recovery=recovered)
    err = errors.DistributedCellError(outcome)
    assert "rank 0 had not returned when the wait was cut short" in str(err), str(err)
    assert "did not return" not in str(err), str(err)
    flat = " ".join(line.strip() for line in err._render_traceback_())
    assert "before the grace period was over; what the session did then is below." in flat, flat
    assert flat.index("what the session did then is below") < flat.index("formed again in 0.2 s"), flat
    alone = errors.DistributedCellError(CellOutcome(ranks={0: _failed(0, Status.STUCK)}, interrupted=True,
                                                    cut_short=True))
    assert "before the grace period was over." in " ".join(line.strip() for line in alone._render_traceback_())


def test_a_long_message_is_one_short_line_in_the_summary_and_whole_in_the_report() -> None:
    """gloo's connection errors end in a paragraph of advice (and an emoji): the one-line summary
    (what nbclient and scripts show) keeps the first line; the traceback keeps it all."""
    evalue = ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\n\n"
              "This usually means a peer crashed. " + "Check the other ranks' logs. " * 10 + "GLHF!")
    tb = (f"DistBackendError: {evalue}",)
    outcome = CellOutcome(ranks={1: RankOutcome(1, Status.ERROR, RankError(1, "DistBackendError", evalue, tb))})
    err = errors.DistributedCellError(outcome)
    assert str(err) == ("rank 1: DistBackendError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:4242 ..."), str(err)
    assert "GLHF!" in "\n".join(err._render_traceback_())


def test_a_headline_is_the_first_line_cut_only_to_a_limit_asked_for() -> None:
    from clorch_repl.common.human import headline

    assert headline("short") == "short"
    assert headline("\n  first  \nsecond") == "first ..."
    assert headline("x" * 200) == "x" * 200  # a long first line is the message itself: kept whole
    assert headline("x" * 200, limit=20) == "x" * 16 + " ..."
    assert headline("") == ""


def test_a_rank_freed_by_the_groups_abort_is_not_said_to_be_interrupted() -> None:
    """Rank 1 raised while rank 0 waited for it in an all_reduce: clorch aborted the group to free
    rank 0, which then came back interrupted. The user interrupted nothing: the summary (the
    error's one line) says what its block says, that the abort freed it (a try-out read "rank 0
    interrupted")."""
    freed = _failed(0, Status.INTERRUPTED)
    freed.freed = True
    raised = _failed(1, Status.ERROR, "ValueError", ("ValueError: boom",))
    outcome = CellOutcome(ranks={0: freed, 1: raised}, group_aborted=True)
    summary = str(errors.DistributedCellError(outcome))
    assert summary.startswith("rank 0 freed from a collective by aborting the group; rank 1: ValueError: boom"), summary
    assert "interrupted" not in summary, summary


def test_a_rank_clorch_interrupted_after_another_failed_is_said_to_be_so() -> None:
    """Rank 0 raised; rank 1, asleep, was interrupted by clorch after the failure grace period:
    its bare KeyboardInterrupt said nothing of who sent it (a try-out)."""
    outcome = CellOutcome(ranks={0: _failed(0, Status.ERROR, "RuntimeError", ("RuntimeError: Timed out",)),
                                 1: _failed(1, Status.INTERRUPTED, "KeyboardInterrupt", ("KeyboardInterrupt",))})
    err = errors.DistributedCellError(outcome)
    assert str(err).startswith("rank 0: RuntimeError: boom; rank 1 interrupted by clorch after rank 0 failed"), str(err)
    flat = " ".join(line.strip() for line in err._render_traceback_())
    assert "rank 1 was interrupted by clorch, not by you: rank 0 failed, and the other ranks are stopped soon after a rank fails" in flat, flat
    yours = errors.DistributedCellError(CellOutcome(ranks=dict(outcome.ranks), interrupted=True))
    assert "by clorch" not in str(yours) and "by clorch" not in " ".join(yours._render_traceback_())
