"""The engine driven from plain Python on a real 2-rank gloo group, as a try-out of it found it:
its refusals and notices name the engine's methods (``session.restart()``), never a magic
(``%clorch restart``), which a script's user cannot type; a cell's ``hang_notice_s`` is checked as
``timeout_s`` is, before any rank is sent anything; and a cell on some ranks only no longer
makes the ranks number later cells apart (``Cell In[4]`` on one, ``In[5]`` on another), so a
failure every rank shares is one traceback, not one per rank.

The notebook's words and numbers are unchanged: tests/unit/test_engine_verbs_units.py compares
the notebook's words, and the notebook's ``[n]`` is checked by
tests/integration/test_merge_output_live.py (``Cell In[n]`` after local cells between)."""

from __future__ import annotations

import math
import re
import shutil
import warnings
from typing import Any, Iterator

import pytest

from clorch_repl.errors import ClorchError, ConfigError, DistributedCellError
from clorch_repl.session.engine import PlainSink, Session, SessionHooks, local_session
from clorch_repl.session.lifecycle import SessionState
from engine_helpers import Lines, engine_session


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    with engine_session(first_cell="refused_cells_ran = 0") as engine:
        yield engine


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _cells_named(outcome: Any) -> dict[int, list[str]]:
    """rank -> the ``Cell In[n]`` its traceback names."""
    return {rank: re.findall(r"Cell In\[\d+\]", _plain("\n".join(part.error.traceback)))
            for rank, part in outcome.ranks.items() if part.error is not None}


# ------------------------------------------------------------------------ the engine's words
def test_why_logs_and_the_debugger_name_the_engines_methods(session: Session) -> None:
    with pytest.raises(ConfigError) as refused:
        session.why([5])
    assert str(refused.value) == "ranks names rank 5, which does not exist (0-1)"
    with pytest.raises(ConfigError) as refused:
        session.logs(5, 10)
    assert str(refused.value) == "session.logs() names rank 5, which does not exist (0-1)"
    with pytest.raises(ConfigError) as refused:
        session.debug_rank(5)
    assert str(refused.value) == "session.debug_rank() names rank 5, which does not exist (0-1)"
    with pytest.raises(ClorchError) as refused:
        session.debug_rank(0)  # JupyterLab's panel: nothing of it in plain Python
    assert str(refused.value) == ("the debugger panel is JupyterLab's: session.debug_rank() works in a notebook "
                                  "kernel only")
    assert session.debugger is None and "rank 1" in session.why([1])  # what works still works


def test_a_suspend_of_cpu_ranks_is_refused_in_the_engines_words(session: Session) -> None:
    with pytest.raises(ClorchError) as refused:
        session.suspend()
    assert str(refused.value) == ("cannot suspend: the ranks run on CPUs (gloo): they hold no GPU to give back; "
                                  "their memory is freed only by session.stop() (which loses their state)")
    with pytest.raises(ClorchError) as refused:
        session.resume()
    assert "%clorch" not in str(refused.value)
    assert session.view().state is SessionState.READY


# ------------------------------------------------------------------------ hang_notice_s
@pytest.mark.parametrize("hang_notice_s, said", [
    (-1, "hang_notice_s must be 0 (off) or a positive number of seconds; got -1"),
    (math.nan, "hang_notice_s must be 0 (off) or a positive number of seconds; got nan"),
    (math.inf, "hang_notice_s must be 0 (off) or a positive number of seconds; got inf"),
    ("soon", "hang_notice_s must be a number of seconds (0 turns it off); got 'soon'"),
    (True, "hang_notice_s must be a number of seconds; got True"),
])
def test_a_bad_hang_notice_is_refused_before_the_cell_is_sent(session: Session, hang_notice_s: Any,
                                                              said: str) -> None:
    for send in (lambda: session.run("refused_cells_ran += 1", None, None, Lines(), hang_notice_s=hang_notice_s),
                 lambda: session.begin("refused_cells_ran += 1", None, None, hang_notice_s=hang_notice_s)):
        with pytest.raises(ConfigError) as refused:
            send()
        assert str(refused.value) == said


def test_no_refused_cell_reached_a_rank_and_good_hang_notices_run(session: Session) -> None:
    shown = Lines()
    assert session.run("print(refused_cells_ran)", None, None, shown, hang_notice_s=0).ok  # 0: off
    assert [shown.text(r).strip() for r in (0, 1)] == ["0", "0"], shown.items
    assert session.run("pass", None, None, None, hang_notice_s=2.5).ok


# ------------------------------------------------------------------------ cell numbers
def test_a_cell_on_some_ranks_leaves_every_rank_naming_later_cells_alike(session: Session) -> None:
    assert session.run("x = 1", [0], None, None).ok  # rank 0 alone: its own count ran ahead
    outcome = session.run("x = 2\nraise ValueError('the same on every rank')", None, None, Lines())
    assert not outcome.ok
    named = _cells_named(outcome)
    assert sorted(named) == [0, 1] and named[0] == named[1] and len(named[0]) == 1, named
    shown = _plain("\n".join(DistributedCellError(outcome)._render_traceback_()))
    assert shown.count("Traceback (most recent call last)") == 1 and "---- ranks 0-1 ----" in shown, shown
    assert session.view().state is SessionState.READY


def test_a_number_the_script_gives_is_the_cells_and_the_next_follow_it(session: Session) -> None:
    failing = "raise ValueError('numbered')"
    assert _cells_named(session.run(failing, [1], None, None, cell_number=40)) == {1: ["Cell In[40]"]}
    assert _cells_named(session.run(failing, None, None, None)) == {0: ["Cell In[41]"], 1: ["Cell In[41]"]}


# ------------------------------------------------------------------------ after a death
def test_a_deaths_notice_and_the_restart_refusal_name_the_engines_methods(session: Session) -> None:
    outcome = session.run("import os\nif rank == 1: os._exit(3)", None, 60, Lines())
    assert not outcome.ok and outcome.recovery is not None, outcome
    assert "session.restart(ranks=[1]) starts it afresh" in outcome.recovery and "%clorch" not in outcome.recovery
    assert session.view().state is SessionState.DEGRADED
    with pytest.raises(ConfigError) as refused:
        session.restart(ranks=[0])  # rank 1, dead, is restarted too: that is every rank
    assert str(refused.value) == ("ranks and the dead ranks name every rank: session.restart() (without ranks) "
                                  "starts them all afresh")
    # the survivor runs on meanwhile, and each such cell says so (a try-out's script learned it
    # only from the outcome's keys), in the script's words, the test's location named
    with pytest.warns(RuntimeWarning) as said:
        later = session.run("print(rank)", None, 30, Lines())
    assert later.ok and list(later.ranks) == [0]
    assert [str(w.message) for w in said] == [
        "clorch: rank 1 died: cells run on rank 0, which has no group (collectives fail) until "
        "session.restart(ranks=[1])"]
    assert said[0].filename == __file__
    with warnings.catch_warnings():  # a script whose warnings are errors: the cell, sent, is still waited for
        warnings.simplefilter("error")
        assert session.run("print(rank)", None, 30, Lines()).ok
    assert session.run("print(rank)", None, 30, Lines()).ok  # nothing left running

    class CtrlCDuringTheNotice(SessionHooks):
        def notice(self, text: str) -> None:
            raise KeyboardInterrupt  # Kernel > Interrupt as the line is said: the cell was sent already

    hooks, session.hooks = session.hooks, CtrlCDuringTheNotice()
    try:
        cut = session.run("import time\ntime.sleep(20)\nprint('never')", None, 60, Lines())
    finally:
        session.hooks = hooks
    assert cut.interrupted and not cut.ok, cut  # ended as interrupted, the ranks interrupted too
    assert session.run("print(rank)", None, 30, Lines()).ok  # not refused as still busy


def test_restart_and_logs_refuse_what_the_notebook_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A try-out's findings: ``restart()`` of a session never started (or stopped) started ranks
    quietly where ``%clorch restart`` refuses; ``logs`` took any ``tail`` (-1 gave nothing, "x" a
    TypeError) where ``--tail`` is checked, and 0 gave nothing where ``--tail 0`` is everything;
    ``logs`` after ``stop()`` said no ranks run where ``%clorch logs`` shows the kept log."""
    monkeypatch.setenv("CLORCH_KEEP_LOGS", "1")  # (the suite's default is 0: nothing left in /tmp)
    session = local_session(2, "gloo")
    with pytest.raises(ConfigError, match=r"nothing to restart: call session\.start\(\) first"):
        session.restart()
    with pytest.raises(ConfigError, match="nothing to restart"):
        session.restart(ranks=[1])
    assert session.group is None  # nothing was started
    session.start()
    try:
        assert session.run("print('in the log', rank)", None, None, PlainSink()).ok
        whole = session.logs(0, None)
        assert "in the log 0" in whole and session.logs(0, 0) == whole == session.logs(0)
        assert session.logs(0, 1).strip() == "in the log 0"
        for bad in (-1, "x", 2.5, True):
            with pytest.raises(ConfigError, match=r"tail must be a whole number of lines, 0 \(everything\) or more"):
                session.logs(0, bad)  # type: ignore[arg-type]
    finally:
        session.stop()
    # stopped, the log is the one its stop kept, as %clorch logs shows it after %clorch stop
    kept = session.logs(0, 1)
    assert kept.startswith("clorch: no ranks are running; rank 0's log as the last session.stop() kept it (")
    assert kept.splitlines()[-1] == "in the log 0", kept
    with pytest.raises(ConfigError, match=r"session\.logs\(\) names rank 2, which does not exist"):
        session.logs(2)
    with pytest.raises(ConfigError, match="tail must be a whole number"):
        session.logs(0, -1)
    shutil.rmtree(session.kept_logs)
    with pytest.raises(ConfigError, match=r"no ranks are running, and .* holds no log of rank 0.*call session\.start\(\) first"):
        session.logs(0)
    # once started, a restart starts it again whatever became of it (a failed restart leaves
    # no launcher, and the notebook's retry of it must work)
    try:
        session.restart()
        assert session.run("print('again', rank)", None, None, PlainSink()).ok
    finally:
        session.stop()
        shutil.rmtree(session.kept_logs, ignore_errors=True)
