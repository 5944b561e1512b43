"""The session's one state (clorch_repl.session.lifecycle): only named moves change it, each legal
only from the states it lists, so that a recovery, a replacement and a stop cannot interleave
into a state nobody meant."""

from __future__ import annotations

import pytest

from clorch_repl.session.lifecycle import MOVES, IllegalMove, Lifecycle, SessionState


def test_a_session_lives_through_start_recovery_loss_replacement_and_stop() -> None:
    life = Lifecycle()
    assert life.state is SessionState.STOPPED and not life.running
    for move, state in (("start", "starting"), ("formed", "ready"), ("abort", "recovering"), ("formed", "ready"),
                        ("abort", "recovering"), ("degrade", "degraded"), ("replace", "recovering"),
                        ("formed", "ready"), ("stop", "stopping"), ("stopped", "stopped")):
        assert life.move(move, f"why {move}").value == state
    assert life.why == "why stopped"


def test_an_illegal_move_says_which_and_changes_nothing() -> None:
    life = Lifecycle()
    with pytest.raises(IllegalMove, match="cannot abort while stopped"):
        life.move("abort")
    assert life.state is SessionState.STOPPED
    assert not life.move_if("stop") and life.state is SessionState.STOPPED  # stopping a stopped session: nothing
    life.move("start")
    assert life.move_if("stop") and life.state is SessionState.STOPPING


def test_cells_run_only_where_there_are_ranks_to_talk_to() -> None:
    running = {state for state in SessionState if Lifecycle(state).running}
    assert running == {SessionState.READY, SessionState.RECOVERING, SessionState.DEGRADED}
    assert all(target in SessionState for _, target in MOVES.values())
