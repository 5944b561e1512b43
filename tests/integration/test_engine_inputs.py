"""``Session.run``'s inputs checked as ``%%distributed`` checks its options, on a real 2-rank gloo
group driven from plain Python: a bad ``timeout_s`` or ``ranks`` is refused before any rank is sent
anything, in the engine's words (``timeout_s``, ``ranks``); and after a stop the session says how a
script starts it again (``session.start()``), and its view says it is stopped."""

from __future__ import annotations

import math
from typing import Any, Iterator

import pytest

from clorch_repl.errors import ConfigError
from clorch_repl.session.engine import Session, local_session
from clorch_repl.session.lifecycle import SessionState
from engine_helpers import Lines, engine_session


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    with engine_session(first_cell="refused_cells_ran = 0") as engine:
        yield engine


#: each refused cell counts itself on the ranks, were it ever sent (it never is)
COUNTED = "import time; time.sleep(0.2); refused_cells_ran += 1"


@pytest.mark.parametrize("timeout_s, said", [
    (0, "timeout_s must be a positive number of seconds; got 0"),
    (-1, "timeout_s must be a positive number of seconds; got -1"),
    (math.nan, "timeout_s must be a positive number of seconds; got nan"),
    ("abc", "timeout_s must be a number of seconds; got 'abc'"),
])
def test_a_bad_time_limit_is_refused_before_the_cell_is_sent(session: Session, timeout_s: Any, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        session.run(COUNTED, None, timeout_s, Lines())
    assert str(refused.value) == said


@pytest.mark.parametrize("ranks, said", [
    ("0", "ranks must be a list of rank numbers, e.g. [0, 1] (None: every rank); got '0'"),
    ([], "ranks names no rank: name at least one (None: every rank)"),
    ([7], "ranks names rank 7, which does not exist (0-1)"),
])
def test_bad_ranks_are_refused_before_the_cell_is_sent(session: Session, ranks: Any, said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        session.run(COUNTED, ranks, 30, Lines())
    assert str(refused.value) == said
    if ranks == []:
        return  # no stdin rank is a choice (stdin_ranks=[]: nobody may ask), run, not refused
    with pytest.raises(ConfigError) as refused:  # the stdin ranks by the same rule, in their own name
        session.run(COUNTED, None, 30, Lines(), stdin_ranks=ranks)
    assert str(refused.value) == said.replace("ranks", "stdin_ranks", 1)


def test_no_refused_cell_reached_a_rank(session: Session) -> None:
    shown = Lines()
    outcome = session.run("print(refused_cells_ran)", None, None, shown)  # None: no time limit, as ever
    assert outcome.ok and [shown.text(r).strip() for r in (0, 1)] == ["0", "0"], shown.items
    assert session.run("print('one')", [1], 30.0, shown).ok  # good inputs still run
    assert session.view().state is SessionState.READY


def test_a_stopped_session_says_how_to_start_it() -> None:
    engine = local_session(2, "gloo")
    assert engine.view().state is SessionState.STOPPED  # before the start: its state, not an error
    engine.start()
    try:
        assert [r.rank for r in engine.view().ranks] == [0, 1]
    finally:
        assert engine.stop() == []
    view = engine.view()
    assert (view.state, view.ranks) == (SessionState.STOPPED, ())
    with pytest.raises(ConfigError) as refused:
        engine.run("1", None, None, None)
    assert str(refused.value) == "no ranks are running: call session.start() first"
