"""Requests to ranks as named handlers and JSON data (issue 27), in this process: the notebook's
builder (clorch_repl.session.requests) writes only its fixed line, refuses what JSON cannot carry
unchanged, and lets nothing a user typed become code; the rank's registry
(clorch_repl.kernel.requests) dispatches by name and says what to do about a name it lacks. The
flows themselves (join, transfers, %clorch run, --profile) run on real ranks in test_session,
test_transfer, test_run_script and test_profile."""

from __future__ import annotations

import ast
import inspect
import json
from typing import Any

import pytest

from clorch_repl.errors import UnknownRequest
from clorch_repl.kernel import requests as registry
from clorch_repl.session.requests import RANK_MODULE, request_code
from clorch_repl.session.script_run import RunRequest

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
    assert decode(request_code("leave")) == ("leave", {})
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


def test_every_request_the_notebook_writes_fits_its_handler() -> None:
    """Each builder's arguments bind to the handler the rank runs for it (no call is made)."""
    written = [
        request_code("join", env={"A": "1"}), request_code("leave"),
        request_code("export_value", name="x", folder="/d", token="t", limit=1),
        request_code("import_value", name="x", path="/d/f.pt", sha256="0" * 64),
        RunRequest(script="t.py", args=("a",)).rank_code(), RunRequest(script="t.py").rank_code(check=True),
        request_code("profile_start"), request_code("profile_stop", folder="/d"),
    ]
    names = set()
    for code in written:
        name, args = decode(code)
        inspect.signature(registry.handler(name)).bind(**args)
        names.add(name)
    assert names == set(registry.HANDLERS)
