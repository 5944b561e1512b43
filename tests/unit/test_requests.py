"""Requests to ranks as named handlers and JSON data (issue 27), in this process: the notebook's
builder (clorch_repl.wire.requests) writes only its fixed line, refuses what JSON cannot carry
unchanged, and lets nothing a user typed become code; the rank's registry
(clorch_repl.kernel.requests) dispatches by name and says what to do about a name it lacks. The
flows themselves (join, transfers, %clorch run, --profile) run on real ranks in test_session,
test_transfer, test_run_script and test_profile."""

from __future__ import annotations

import ast
import inspect
import json
from types import SimpleNamespace
from typing import Any

import pytest

from clorch_repl.errors import ClorchError, UnknownRequest
from clorch_repl.kernel import requests as registry
from clorch_repl.wire.requests import RANK_MODULE, request_code
from clorch_repl.session import profile, recovery, script_run, transfer
from clorch_repl.session.protocol import CellOutcome, CellRequest
from clorch_repl.session.script_run import RunRequest
from clorch_repl.common.topology import Topology

INJECTION = "'); import os; ('"


def decode(code: str) -> tuple[str, dict[str, Any]]:
    """The name and arguments of a request's code, checking that it is the fixed form: one
    expression, ``__import__(RANK_MODULE, fromlist=['_']).call(NAME, JSON)``, literals only."""
    tree = ast.parse(code)
    assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr), code
    call = tree.body[0].value
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "call"
    outer = call.func.value
    assert isinstance(outer, ast.Call) and isinstance(outer.func, ast.Name) and outer.func.id == "__import__"
    assert ast.literal_eval(outer.args[0]) == RANK_MODULE
    assert not call.keywords and len(call.args) == 2
    name, text = (ast.literal_eval(arg) for arg in call.args)  # literals, or this raises
    return name, json.loads(text)


def test_the_request_is_the_fixed_line_with_json_arguments() -> None:
    code = request_code("join", env={"MASTER_PORT": "29500", "X": "a'b\"c\n"})
    assert "\n" not in code
    assert decode(code) == ("join", {"env": {"MASTER_PORT": "29500", "X": "a'b\"c\n"}})
    assert decode(request_code("profile_stop")) == ("profile_stop", {})
    assert decode(request_code("export_value", name=None, folder="/d", token="ab", limit=10)) == (
        "export_value", {"name": None, "folder": "/d", "token": "ab", "limit": 10})


def test_a_script_argument_never_becomes_code() -> None:
    args = (INJECTION, 'x" ; print(1) #', "\\'", "é ✓")
    request = RunRequest(script=f"/tmp/{INJECTION}.py", args=args)
    for code in (request.rank_code(), request.rank_code(check=True)):
        name, decoded = decode(code)  # one call of literals: nothing of the input is a statement
        assert decoded["script"] == f"/tmp/{INJECTION}.py"
    assert decode(request.rank_code())[1]["args"] == list(args)


@pytest.mark.parametrize("value, words", [
    ((1, 2), "argument args is a tuple"),
    ({"a": {1, 2}}, "argument args['a'] is a set"),
    ([1, float("nan")], "argument args[1] is nan"),
    ({1: "x"}, "has the key 1"),
    (object(), "not JSON data"),
])
def test_what_json_cannot_carry_unchanged_is_refused(value: Any, words: str) -> None:
    with pytest.raises(TypeError, match="request 'script_run'") as info:
        request_code("script_run", args=value)
    assert words in str(info.value)


def test_a_request_name_is_an_identifier() -> None:
    with pytest.raises(TypeError, match="lower-case identifier"):
        request_code("join'); import os; ('")


#: a registry of one handler with a fixed signature, dedent(text)
TABLE = {"dedent": "textwrap:dedent"}


def test_the_registry_dispatches_by_name_with_the_json_arguments() -> None:
    assert registry.call("dedent", json.dumps({"text": "  a\n  b"}), handlers=TABLE) == "a\nb"


def test_an_unknown_name_says_which_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(UnknownRequest) as info:
        registry.call("defragment", "{}")
    text = str(info.value)
    assert "rank 3 has no request 'defragment'" in text and "join" in text
    assert "same version" in text and "%clorch restart" in text


def test_arguments_a_handler_does_not_take_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(UnknownRequest, match="rank 1 cannot take request 'dedent' with arguments colour, text"):
        registry.call("dedent", json.dumps({"text": "x", "colour": "red"}), handlers=TABLE)
    with pytest.raises(TypeError, match="must be a JSON object"):
        registry.call("dedent", "[1]", handlers=TABLE)


class RecordingSession:
    """Stands in for the session (no ranks: this half starts no process) and records the code of
    every request the notebook's own call sites send; each "ran" everywhere without output."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.codes: list[str] = []
        self.topology = Topology(2, (None, None), "gloo", 60.0)

    def chosen(self, ranks: list[int] | None) -> tuple[int, ...]:
        return (0, 1) if ranks is None else tuple(ranks)

    def hosts(self) -> dict[int, str]:
        return {}

    def value_dir(self) -> str:
        return self.folder

    def run(self, code: str, ranks: Any, *args: Any, **kwargs: Any) -> CellOutcome:
        self.codes.append(code)
        return CellOutcome()


class RecordingRelay:
    """The relay as the session's start and stop use it, recording the code of what they send."""

    codes: list[str] = []

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def set_comm_sink(self, sink: Any) -> None: ...
    def connect(self, progress: Any, timeout_s: float = 0.0, ranks: Any = None) -> None: ...
    def close(self) -> None: ...

    def idle(self, rank: int) -> bool:
        return True

    def busy(self) -> list[int]:
        return []

    def light_answers(self) -> dict[int, dict[str, Any]]:
        """A save in flight on both ranks: the polite stop waits for it (finish_saves)."""
        return {r: {"saves": [{"path": "/ckpt", "for_s": 1.0}]} for r in (0, 1)}

    def execute(self, request: CellRequest, *args: Any, **kwargs: Any) -> CellOutcome:
        RecordingRelay.codes.append(request.code)
        return CellOutcome()


class QuietLauncher:
    """Two "ranks" that are always there, and a meeting point for spares (join_environment)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.ranks = [SimpleNamespace(rank=r, alive=True, exit=None, host="") for r in (0, 1)]
        self.from_spares = False

    def launch(self, progress: Any) -> None: ...
    def replace(self, ranks: Any, progress: Any) -> None: ...
    def group_formed(self) -> None: ...
    def stop(self, *args: Any, **kwargs: Any) -> list[str]:
        return []
    def close(self) -> None: ...

    def join_environment(self) -> dict[str, str]:
        return {"MASTER_PORT": "29511"}


def _sent_by_the_call_sites(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The code of every request, as the notebook's own call sites write it: a start (join) and a
    stop (finish_saves: a save in flight), a re-form after an abort and a replaced rank (regroup), a pull, a push, %clorch run (its check and the run), --profile (start, stop)."""
    from clorch_repl.session import session as session_module

    monkeypatch.setattr(session_module, "Relay", RecordingRelay)
    RecordingRelay.codes = []
    live = session_module.Session(Topology(2, (None, None), "gloo", 60.0), QuietLauncher)
    live.start()
    relay, launcher = live.relay, live.group
    recovery.after_abort(relay, launcher, 1, 0.0)  # the group formed again after an abort
    recovery.replace(relay, launcher, [1], 2, lambda _: None)  # a fresh rank 1 joins the others
    live.stop()
    session = RecordingSession(str(tmp_path))
    with pytest.raises(ClorchError, match="did not report its value"):  # nobody answers here
        transfer.pull(session, "x", None, 1_000_000)
    transfer.push(session, "x", {"a": 1}, [1], 1_000_000)
    script_run.run(session, RunRequest(script=f"t{INJECTION}.py", args=(INJECTION,)))
    profile.profiled(session, None, str(tmp_path / "traces"), CellOutcome)
    return RecordingRelay.codes + session.codes


def test_every_request_the_notebook_sends_fits_its_handler(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call site's arguments bind to the handler the rank runs for it (none is called), and
    every name the rank answers is sent by some call site: a call site that sends a keyword its
    handler lacks fails here, not first on real ranks."""
    names = set()
    for code in _sent_by_the_call_sites(tmp_path, monkeypatch):
        name, args = decode(code)
        inspect.signature(registry.handler(name)).bind(**args)
        names.add(name)
    assert names == set(registry.HANDLERS)
