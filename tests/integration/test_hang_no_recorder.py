"""Ranks started without the flight recorder (CLORCH_FLIGHT_RECORDER=0): ``%clorch why`` still
answers from the stacks and says which ranks have no collective record and why."""

from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output


@pytest.fixture()
def unrecorded(ip: Any, magics: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    magics.shutdown()
    monkeypatch.setenv("CLORCH_FLIGHT_RECORDER", "0")  # the ranks inherit the notebook's environment
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ip.run_line_magic("clorch", "start --nproc 2 --backend gloo")
    try:
        yield magics
    finally:
        magics.shutdown()


def test_why_without_the_recorder_says_so_and_uses_stacks(ip: Any, unrecorded: Any) -> None:
    with capture_output() as cap:
        ip.run_line_magic("clorch", "why")
    lines = cap.stdout.splitlines()
    assert lines[0] == ("no collective is pending: ranks 0-1 are not running a cell "
                        "(no collective record from ranks 0-1: the flight recorder is off "
                        "(TORCH_FR_BUFFER_SIZE=0); judged from stacks)"), lines[0]
    assert "  collectives: unknown (the flight recorder is off (TORCH_FR_BUFFER_SIZE=0))" in lines
