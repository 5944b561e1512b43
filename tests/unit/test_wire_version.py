"""The wire contract's one version (clorch_repl.wire.PROTOCOL_VERSION), checked where a rank
connects: its join. The request runs here as a rank runs it (the notebook's line, the rank's
registry, the real join handler), refused before the join touches anything; the nanny's side of the
same check is tests/unit/test_nanny_protocol.py's (real CurveZMQ sockets)."""

from __future__ import annotations

import os

import pytest

from clorch_repl import __version__
from clorch_repl.errors import ProtocolMismatch
from clorch_repl.wire import PROTOCOL_VERSION, mismatch
from clorch_repl.wire.nanny import PROTOCOL
from clorch_repl.wire.requests import request_code


def test_a_rank_refuses_to_join_a_notebook_of_another_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("CLORCH_TEST_JOIN_ENV", raising=False)
    line = request_code("join", env={"CLORCH_TEST_JOIN_ENV": "1"}, protocol=PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolMismatch) as refused:
        exec(line)  # noqa: S102 - the fixed request line the relay sends, run as the rank runs it
    text = str(refused.value)
    assert text.startswith(f"rank 3 cannot join: the notebook speaks protocol {PROTOCOL_VERSION + 1}, "
                           f"this clorch_repl speaks protocol {PROTOCOL_VERSION}: "), text
    assert f"this rank runs clorch_repl {__version__}" in text and "restart the notebook's kernel" in text
    assert "CLORCH_TEST_JOIN_ENV" not in os.environ  # refused before the join changed anything


def test_a_notebook_that_sends_no_version_is_told_to_run_the_same_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ProtocolMismatch, match=r"rank 0 cannot join: the notebook speaks no protocol version \(a "
                       r"clorch_repl from before the version was checked\).*restart the notebook's kernel"):
        exec(request_code("join", env={}))  # noqa: S102 - what a notebook from before the check sends


def test_the_nanny_speaks_the_contracts_one_version() -> None:
    assert PROTOCOL == PROTOCOL_VERSION
    assert mismatch(PROTOCOL_VERSION, "x") is None
    assert mismatch(None, "rank 1 on hostB") == (
        f"rank 1 on hostB speaks no protocol version (a clorch_repl from before the version was checked), "
        f"this clorch_repl speaks protocol {PROTOCOL_VERSION}: install the same clorch_repl version on every host")
