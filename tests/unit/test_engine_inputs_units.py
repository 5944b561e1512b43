"""The engine's refusals of a cell's inputs and of a session without ranks, in its own words
(``timeout_s``, ``ranks``, ``session.start()``) while the notebook's stay the magics' (``--timeout``,
``--ranks``, ``%clorch start``); and the view of a session that is not started. No process: the
session here is never started (the live half is tests/integration/test_engine_inputs.py)."""

from __future__ import annotations

import math

import pytest

from clorch_repl.errors import ConfigError
from clorch_repl.notebook.hooks import NotebookHooks
from clorch_repl.session.cell_rules import cell_ranks, cell_request
from clorch_repl.session.engine import local_session
from clorch_repl.session.hooks import SCRIPT_VERBS, SessionHooks
from clorch_repl.session.lifecycle import Lifecycle, SessionState


def test_a_session_without_ranks_names_the_start_as_its_driver_does() -> None:
    engine = local_session(2, "gloo")
    for call in (lambda: engine.run("1", None, None, None), lambda: engine.begin("1", None, None),
                 engine.status, lambda: engine.interrupt()):
        with pytest.raises(ConfigError) as refused:
            call()
        assert str(refused.value) == "no ranks are running: call session.start() first"
    assert engine.stop() == []  # a stop before any start: the same words after it
    with pytest.raises(ConfigError, match=r"^no ranks are running: call session\.start\(\) first$"):
        engine.run("1", None, None, None)
    notebook = local_session(2, "gloo", hooks=NotebookHooks())
    with pytest.raises(ConfigError, match=r"^no ranks are running: run %clorch start first$"):
        notebook.run("1", None, None, None)


def test_the_view_of_a_session_not_started_says_stopped() -> None:
    engine = local_session(2, "gloo")
    view = engine.view()
    assert (view.state, view.ranks, view.alive, view.started_at) == (SessionState.STOPPED, (), [], None)
    assert (view.backend, view.launcher, view.generation) == ("gloo", "local", 0)
    engine.stop()
    assert engine.view().state is SessionState.STOPPED


@pytest.mark.parametrize("ranks, said", [
    ([7], "ranks names rank 7, which does not exist (0-1)"),
    ([0, 0], "ranks repeats 0: each rank may appear once"),
    ([-1], "ranks names rank -1: rank numbers start at 0"),
    ([], "ranks names no rank: name at least one (None: every rank)"),
    ("0", "ranks must be a list of rank numbers, e.g. [0, 1] (None: every rank); got '0'"),
    (0, "ranks must be a list of rank numbers, e.g. [0, 1] (None: every rank); got 0"),
    ([True], "ranks must be a list of rank numbers, e.g. [0, 1] (None: every rank); got [True]"),
    ([0.5], "ranks must be a list of rank numbers, e.g. [0, 1] (None: every rank); got [0.5]"),
    (["1"], "ranks must be a list of rank numbers, e.g. [0, 1] (None: every rank); got ['1']"),
])
def test_a_cells_ranks_are_refused_in_the_engines_words(ranks: object, said: str) -> None:
    engine = local_session(2, "gloo")
    with pytest.raises(ConfigError) as refused:
        engine.chosen(ranks)  # type: ignore[arg-type]
    assert str(refused.value) == said
    notebook = local_session(2, "gloo", hooks=NotebookHooks())  # the magic's option, as its user types it
    with pytest.raises(ConfigError) as refused:
        notebook.chosen(ranks)  # type: ignore[arg-type]
    assert str(refused.value) == "--" + said


def test_good_ranks_pass_as_a_tuple() -> None:
    assert cell_ranks([1, 0], 2, "ranks") == (1, 0)
    assert cell_ranks(range(2), 2, "ranks") == (0, 1)
    assert local_session(2, "gloo").chosen(None) == (0, 1)


@pytest.mark.parametrize("timeout, said", [
    (0, "timeout_s must be a positive number of seconds; got 0"),
    (-1, "timeout_s must be a positive number of seconds; got -1"),
    (math.nan, "timeout_s must be a positive number of seconds; got nan"),
    (math.inf, "timeout_s must be a positive number of seconds; got inf"),
    ("abc", "timeout_s must be a number of seconds; got 'abc'"),
    (True, "timeout_s must be a number of seconds; got True"),
])
def test_a_cells_time_limit_is_refused_before_anything_is_asked(timeout: object, said: str) -> None:
    # group and relay are never reached: the time limit is refused first
    for verbs, prefix in ((SCRIPT_VERBS, ""), (NotebookHooks.verbs, "--timeout")):
        with pytest.raises(ConfigError) as refused:
            cell_request("1", (0,), timeout, group=None, relay=None, life=Lifecycle(),  # type: ignore[arg-type]
                         nproc=2, hang_notice_s=0.0, verbs=verbs)
        assert str(refused.value) == (said if not prefix else said.replace("timeout_s", prefix))


def test_the_engines_hooks_name_the_engines_parameters() -> None:
    verbs = SessionHooks().verbs
    assert (verbs.to_start, verbs.ranks, verbs.stdin_ranks, verbs.timeout) == (
        "call session.start()", "ranks", "stdin_ranks", "timeout_s")
    notebook = NotebookHooks.verbs  # the magics' words, unchanged
    assert (notebook.to_start, notebook.ranks, notebook.stdin_ranks, notebook.timeout) == (
        "run %clorch start", "--ranks", "--stdin-ranks", "--timeout")


def test_no_stdin_rank_is_a_choice_where_no_rank_to_run_on_is_not() -> None:
    """``stdin_ranks=[]`` says no rank may ask for input (a review: the first check refused it)."""
    from clorch_repl.errors import ConfigError
    from clorch_repl.session.cell_rules import cell_ranks

    assert cell_ranks([], 2, "stdin_ranks", empty=True) == ()
    with pytest.raises(ConfigError, match="ranks names no rank"):
        cell_ranks([], 2, "ranks")
