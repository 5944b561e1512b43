"""A bad CLORCH_NPROC is named by %clorch start, before any rank starts. ``clorch-notebook run``
with real ranks: tests/integration/test_notebook_runner.py."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("value", ["two", "0", "-1"])
def test_a_bad_clorch_nproc_is_named_by_start(ip, magics, monkeypatch, value: str) -> None:
    """The default that --nproc sets through the environment is validated where it is read, and
    the message names the variable (the user never typed --nproc)."""
    from IPython.utils.capture import capture_output

    magics.shutdown()
    monkeypatch.setenv("CLORCH_NPROC", value)
    with capture_output() as cap:
        result = ip.run_cell("%clorch start")
    assert not result.success
    assert f"CLORCH_NPROC={value!r} in the environment must be a whole number of ranks >= 1" in cap.stdout + cap.stderr
    assert magics.session is None or not magics.session.running
