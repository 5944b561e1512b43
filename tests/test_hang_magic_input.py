"""Mistakes in the hang-diagnosis options give one clear line, before any rank is started."""

from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output


def say(ip: Any, line: str) -> tuple[Any, str]:
    with capture_output() as cap:
        result = ip.run_cell(line)
    return result, cap.stdout + cap.stderr


@pytest.fixture()
def no_session(ip: Any, magics: Any) -> Any:
    magics.shutdown()
    return ip


@pytest.mark.parametrize("line, message", [
    ("%clorch start --hang-notice -1", "--hang-notice must be 0 (off) or a positive number of seconds; got '-1'"),
    ("%clorch start --hang-notice soon", "--hang-notice must be a number of seconds (0 turns it off); got 'soon'"),
    ("%clorch start --hang-notice inf", "--hang-notice must be 0 (off) or a positive number of seconds"),
    ("%%distributed --hang-notice -3\npass", "--hang-notice must be 0 (off) or a positive number of seconds"),
    ("%clorch why", "no ranks are running: run %clorch start first"),
    ("%clorch why --rank one", "--rank must be a rank number; got 'one'"),
    ("%clorch why --bogus", "unrecognized arguments: --bogus"),
])
def test_bad_hang_options_give_one_clear_line(no_session: Any, magics: Any, line: str, message: str) -> None:
    result, out = say(no_session, line)
    assert not result.success
    assert message in out, out
    assert "Traceback" not in out and "clorch_repl/" not in out
    assert len([l for l in out.splitlines() if l.strip()]) == 1, out
    assert magics.session is None  # nothing was started


def test_why_and_hang_notice_have_help(no_session: Any) -> None:
    _, out = say(no_session, "%clorch why --help")
    assert "--rank" in out and "--all-threads" in out
    _, out = say(no_session, "%%distributed --help\npass")
    assert "--hang-notice" in out
    _, out = say(no_session, "%clorch --help")
    assert "why" in out
