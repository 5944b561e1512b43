"""The engine's words and its cell numbers, without ranks (stand-ins where a suspend needs a GPU):
every refusal and notice reachable from ``Session`` (why, logs, the debugger, suspend and resume,
a recovery's line, the refusal of a restart that names every rank) names what a script calls
(``session.resume()``) by default and what the notebook's user types (``%clorch resume``) under
the notebook's hooks, word for word as the notebook said it before; ``hang_notice_s`` is checked
as ``--hang-notice`` is, named as each driver names it; and the session numbers a script's cells
while the notebook's (``numbers_cells``) stay the notebook's ``[n]``, its own requests unnumbered.

The same on real ranks, where no GPU is needed: tests/integration/test_engine_script_words.py."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import pytest

from clorch_repl.common.topology import Topology
from clorch_repl.errors import ClorchError, ConfigError
from clorch_repl.notebook.hooks import NotebookHooks
from clorch_repl.session import recovery
from clorch_repl.session import suspend as susp
from clorch_repl.session.cell_rules import cell_request
from clorch_repl.session.hooks import SCRIPT_VERBS, SessionHooks, Verbs
from clorch_repl.session.lifecycle import Lifecycle, SessionState
from clorch_repl.session.session import Session

GPU = Topology(nproc=2, devices=(0, 1), backend="nccl", timeout_s=600)
CPU = Topology(nproc=2, devices=(None, None), backend="gloo", timeout_s=600)
S = SessionState
NOTEBOOK = NotebookHooks.verbs


def test_the_notebooks_words_are_its_magics_and_the_engines_its_methods() -> None:
    assert dataclasses.asdict(NOTEBOOK) == {
        "interrupt": "%clorch interrupt", "restart": "%clorch restart",
        "restart_ranks": "%clorch restart --ranks {ranks}", "to_start": "run %clorch start", "ranks": "--ranks",
        "stdin_ranks": "--stdin-ranks", "timeout": "--timeout", "hang_notice": "--hang-notice",
        "restart_some": "%clorch restart --ranks", "start": "%clorch start", "stop": "%clorch stop",
        "status": "%clorch status", "suspend": "%clorch suspend", "resume": "%clorch resume", "why": "%clorch why",
        "why_ranks": "--rank", "debugger": "%clorch debugger", "logs": "logs",
        "stdin_refused": ("only {allowed} may read input in this cell (%%distributed --stdin-ranks); add rank {rank} "
                          "there to answer its prompts from the notebook")}
    assert SessionHooks().verbs is SCRIPT_VERBS and SCRIPT_VERBS == Verbs()
    assert not any("%" in word for word in dataclasses.asdict(SCRIPT_VERBS).values())
    with pytest.raises(ClorchError, match=r"^the debugger panel is JupyterLab's: session.debug_rank\(\) works in"):
        SessionHooks().debugger(None, 0)


class _Launcher:
    """Stands in for a local launcher of 2 GPU ranks, which can replace and restart ranks."""

    name = "local"

    def __init__(self, alive: tuple[bool, ...] = (True, True)) -> None:
        self.ranks = [SimpleNamespace(rank=r, pid=100 + r, host="", alive=a, exit=None if a else "exit code 3")
                      for r, a in enumerate(alive)]
        self.spares: list[Any] = []

    def instead_of_replacing(self, ranks: list[int]) -> str:
        return ""

    def instead_of_restarting(self) -> str:
        return ""

    def dead(self, ranks: Any = None) -> list[int]:
        return [p.rank for p in self.ranks if not p.alive and (ranks is None or p.rank in ranks)]

    def memory(self) -> dict[int, tuple[int | None, int | None]]:
        return {0: (2**30, 20 * 2**30), 1: (2**30, 20 * 2**30)}

    def group_formed(self) -> None:
        pass

    def _end(self, handles: list[Any], grace_s: float, polite: bool) -> list[str]:
        return []


# ------------------------------------------------------------------------------ suspend, resume
def test_the_suspend_refusals_say_each_drivers_words_the_notebooks_as_before() -> None:
    local = _Launcher()
    said = {
        "busy": lambda v: susp.refusal(S.READY, GPU, [1], [], local, v),
        "dead": lambda v: susp.refusal(S.READY, GPU, [], [0], local, v),
        "again": lambda v: susp.refusal(S.SUSPENDED, GPU, [], [], local, v),
        "degraded": lambda v: susp.refusal(S.DEGRADED, GPU, [], [], local, v),
        "cpu": lambda v: susp.cpu_refusal(CPU, v),
        "fresh": lambda v: susp._fresh(local, v),
        "room": lambda v: susp.room_problem(GPU, {1: 20 * 2**30}, lambda gpu: (2**30, ["pid 7 (python, 9.0 GiB)"]),
                                            verbs=v),
    }
    assert {k: f(NOTEBOOK) for k, f in said.items()} == {
        "busy": "rank 1 is running a cell: wait for it to finish or %clorch interrupt, then %clorch suspend",
        "dead": "rank 0 is dead: %clorch restart --ranks 0 first",
        "again": "the session is suspended already: %clorch resume gives every rank its GPU back",
        "degraded": "the session is degraded: suspend needs every rank alive in its group (%clorch status says why; "
                    "%clorch restart --ranks or %clorch restart first)",
        "cpu": "the ranks run on CPUs (gloo): they hold no GPU to give back; their memory is freed only by "
               "%clorch stop (which loses their state)",
        "fresh": "%clorch restart gives fresh ranks and a fresh group",
        "room": "rank 1's GPU 1 has 1.0 GiB free and rank 1 needs 20.0 GiB; it is held by pid 7 (python, 9.0 GiB): "
                "each rank goes back to its own GPU only; free it and run %clorch resume again"}
    assert {k: f(SCRIPT_VERBS) for k, f in said.items()} == {
        "busy": "rank 1 is running a cell: wait for it to finish or session.interrupt(), then session.suspend()",
        "dead": "rank 0 is dead: session.restart(ranks=[0]) first",
        "again": "the session is suspended already: session.resume() gives every rank its GPU back",
        "degraded": "the session is degraded: suspend needs every rank alive in its group (session.status() says "
                    "why; session.restart(ranks=...) or session.restart() first)",
        "cpu": "the ranks run on CPUs (gloo): they hold no GPU to give back; their memory is freed only by "
               "session.stop() (which loses their state)",
        "fresh": "session.restart() gives fresh ranks and a fresh group",
        "room": "rank 1's GPU 1 has 1.0 GiB free and rank 1 needs 20.0 GiB; it is held by pid 7 (python, 9.0 GiB): "
                "each rank goes back to its own GPU only; free it and run session.resume() again"}


class _Relay:
    """Stands in for the ranks' channels: the abort is confirmed, the re-form works."""

    def __init__(self) -> None:
        self.channels = self.prober = self

    def busy(self) -> list[int]:
        return []

    def ask(self, ranks: list[int], **_: Any) -> dict[int, Any]:
        return {r: {"communicators": 1} for r in ranks}

    def execute(self, request: Any, sink: Any = None, *, silent: bool = False) -> Any:
        return SimpleNamespace(ok=True, failed=[], interrupted=False)


def _session(hooks: SessionHooks, monkeypatch: pytest.MonkeyPatch, restore_fails: bool = False) -> Session:
    def drive(action: str, launcher: Any, ranks: list[int], held: int, verbs: Verbs = SCRIPT_VERBS) -> dict:
        failed = restore_fails and action == "resume"
        return {r: susp.Moved(r, not (failed and r == 1), {}, "rank 1: out of memory" if failed else "")
                for r in ranks}

    monkeypatch.setattr(susp, "drive", drive)  # stand-in for the driver's helper (no GPU here)
    monkeypatch.setattr(susp.cuda_checkpoint, "api_problem", lambda: None)
    monkeypatch.setattr(susp, "who_holds", lambda *_, **__: "")
    session = Session(GPU, hooks=hooks)
    session.group, session.relay = _Launcher(), _Relay()  # type: ignore[assignment]
    session.life = Lifecycle(S.READY)
    return session


@pytest.mark.parametrize("hooks, resume, why, suspend", [
    (SessionHooks(), "session.resume()", "session.why()", "session.suspend()"),
    (NotebookHooks(), "%clorch resume", "%clorch why", "%clorch suspend"),
])
def test_a_suspended_session_says_the_drivers_words(monkeypatch: pytest.MonkeyPatch, hooks: SessionHooks,
                                                    resume: str, why: str, suspend: str) -> None:
    session = _session(hooks, monkeypatch, restore_fails=True)
    with pytest.raises(ClorchError) as refused:
        session.resume()
    assert str(refused.value) == f"nothing to resume: the session is ready ({suspend} gives the GPUs back)"
    line = session.suspend()
    assert line.endswith(f"each rank keeps its variables; {resume} brings them back"), line
    assert session.life.why.endswith(f"; {resume}")  # what status says while suspended
    with pytest.raises(ClorchError) as refused:
        session.why()
    assert str(refused.value).endswith(f": {resume} gives them their GPUs back, then {why}")
    with pytest.raises(ClorchError) as refused:
        session.run("x = 1", None, None, None)
    assert str(refused.value).endswith(f": {resume} gives them their GPUs back, then run the cell again")
    with pytest.raises(ClorchError) as refused:
        session.resume()  # rank 1's restore fails: back to suspended, to be retried
    assert str(refused.value) == ("cannot resume yet: rank 1: out of memory; the session stays suspended: "
                                  f"run {resume} again")
    assert session.life.state is S.SUSPENDED


# ------------------------------------------------------------------------------ after a death
def test_a_recoverys_lines_say_each_drivers_words() -> None:
    launcher = _Launcher(alive=(True, False))
    for verbs, restart, one in ((SCRIPT_VERBS, "session.restart()", "session.restart(ranks=[1])"),
                                (NOTEBOOK, "%clorch restart", "%clorch restart --ranks 1")):
        line = recovery.lost(launcher, [1], [], verbs=verbs).line  # type: ignore[arg-type]
        assert line == (f"clorch: rank 1 died; rank 0 kept its variables but has no group until {one} starts it "
                        "afresh and forms the group again (cells run on rank 0 meanwhile; collectives there fail)")
        with pytest.raises(ClorchError) as refused:
            recovery.survivors(launcher, [0, 1], "ranks 0-1 died", verbs)  # type: ignore[arg-type]
        assert str(refused.value) == (f"no rank is left to run on (ranks 0-1 died): {restart} starts every rank "
                                      "afresh and forms the group again (their variables are gone)")


@pytest.mark.parametrize("hooks, said", [
    (SessionHooks(), "ranks and the dead ranks name every rank: session.restart() (without ranks) starts them all "
                     "afresh"),
    (NotebookHooks(), "--ranks and the dead ranks name every rank: %clorch restart (without --ranks) starts them "
                      "all afresh"),
])
def test_a_restart_of_some_ranks_that_is_every_rank_is_refused_in_the_drivers_words(
        hooks: SessionHooks, said: str) -> None:
    session = Session(GPU, hooks=hooks)
    session.group, session.relay = _Launcher(alive=(True, False)), _Relay()  # type: ignore[assignment]
    session.group.cannot_replace = lambda ranks: ""  # type: ignore[attr-defined]
    session.life = Lifecycle(S.DEGRADED)
    with pytest.raises(ConfigError) as refused:
        session.restart(ranks=[0])  # and rank 1, dead: every rank
    assert str(refused.value) == said


# ------------------------------------------------------------------------------ hang_notice_s
@pytest.mark.parametrize("hang_notice_s, said", [
    (-1, "hang_notice_s must be 0 (off) or a positive number of seconds; got -1"),
    (math.nan, "hang_notice_s must be 0 (off) or a positive number of seconds; got nan"),
    ("soon", "hang_notice_s must be a number of seconds (0 turns it off); got 'soon'"),
    (True, "hang_notice_s must be a number of seconds; got True"),
])
def test_a_cells_hang_notice_is_refused_before_anything_is_asked(hang_notice_s: object, said: str) -> None:
    for verbs, name in ((SCRIPT_VERBS, "hang_notice_s"), (NOTEBOOK, "--hang-notice")):
        with pytest.raises(ConfigError) as refused:  # group and relay are never reached
            cell_request("1", (0,), None, group=None, relay=None, life=Lifecycle(),  # type: ignore[arg-type]
                         nproc=2, hang_notice_s=hang_notice_s, verbs=verbs)  # type: ignore[arg-type]
        assert str(refused.value) == said.replace("hang_notice_s", name)


# ------------------------------------------------------------------------------ cell numbers
class _Sending(_Relay):
    """Stands in for the relay: keeps each request sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Any] = []

    def begin(self, request: Any, stdin: Any = None) -> Any:
        self.sent.append(request)
        return SimpleNamespace(request=request)


def _numbers(hooks: SessionHooks, given: list[int | None]) -> list[int | None]:
    """The cell numbers the ranks are sent for cells given ``given`` numbers (None: none)."""
    session = Session(CPU, hooks=hooks)
    relay = _Sending()
    session.group, session.relay = _Launcher(), relay  # type: ignore[assignment]
    session.life = Lifecycle(S.READY)
    for number in given:
        session.begin("pass", [0] if number is None else None, None, cell_number=number)
    return [request.cell_number for request in relay.sent]


def test_a_scripts_cells_are_numbered_by_the_session_and_the_notebooks_by_the_notebook() -> None:
    assert SessionHooks.numbers_cells is False and NotebookHooks.numbers_cells is True
    assert _numbers(SessionHooks(), [None, None, 40, None, 7, None]) == [1, 2, 40, 41, 7, 42]
    # the notebook: each %%distributed cell its [n]; its own requests (%clorch debug) unnumbered, as before
    assert _numbers(NotebookHooks(), [12, None, 13, None]) == [12, None, 13, None]


@pytest.mark.parametrize("number", [-1, True, 2.0, "3"])
def test_a_cell_number_that_is_no_whole_number_is_refused_before_anything_is_asked(number: object) -> None:
    with pytest.raises(ConfigError) as refused:
        _numbers(SessionHooks(), [number])  # type: ignore[list-item]
    assert str(refused.value) == ("cell_number must be a whole number, 0 or more (None: the session numbers the "
                                  f"cell); got {number!r}")
