"""A rank's tracebacks end at the user's line (clorch_repl.kernel.tracebacks), also when two of
the package's cuts meet: a Ctrl-C that lands in the rank's stream while a request runs user code
(a %clorch run script printing in a loop) is cut first by the stream (its own frames) and then by
the request it leaves (the dispatcher's frames); neither cut may bring back the other's frames.

The frames come from real code compiled under chosen file names. The shell is a stand-in
(IPython's renderer only formats the traceback it is given; here it lists the frames' files)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from clorch_repl.kernel import tracebacks


class ListingShell:
    """Renders a traceback as the file names of its frames, innermost last."""

    class InteractiveTB:
        @staticmethod
        def structured_traceback(etype: Any, value: Any, tb: types.TracebackType | None) -> list[str]:
            files = []
            while tb is not None:
                files.append(tb.tb_frame.f_code.co_filename)
                tb = tb.tb_next
            return files


def _function(name: str, file: str, body: str, **globals_: Any) -> Any:
    namespace = dict(globals_)
    exec(compile(f"def {name}():\n    {body}\n", file, "exec"), namespace)  # noqa: S102 - test code
    return namespace[name]


@pytest.fixture()
def shell(monkeypatch: pytest.MonkeyPatch) -> ListingShell:
    import IPython

    stand_in = ListingShell()
    monkeypatch.setattr(IPython, "get_ipython", lambda: stand_in)
    return stand_in


def test_a_ctrl_c_in_the_stream_under_a_request_ends_at_the_users_line(shell: ListingShell) -> None:
    def write() -> None:
        raise KeyboardInterrupt

    stream_write = tracebacks.interrupts_at_users_line(
        _function("write", "/pkg/kernel/output.py", "inner()", inner=write), "/pkg/kernel/output.py")
    user = _function("loop", "/home/me/train.py", "write()", write=stream_write)
    dispatcher = _function("call", "/pkg/kernel/requests.py", "run()", run=user)
    tracebacks.hide_frames_of("/pkg/kernel/requests.py")
    try:
        try:
            dispatcher()
        except BaseException as exc:  # what kernel/requests.call does with whatever it leaves
            tracebacks.hide_own_frames(exc)
            raise
    except KeyboardInterrupt as exc:
        shown = exc._render_traceback_()  # type: ignore[attr-defined]
    # this test's frame, the user's loop, and the innermost frame (this file's stand-in write)
    assert shown == [__file__, "/home/me/train.py", __file__], shown
