"""A rank's own half of stdin: ``input()`` and ``getpass()`` in a rank kernel, refused with the
reason where the relay said this cell may not read stdin (the rank is not in ``--stdin-ranks``,
or the notebook's front end takes no input), and otherwise ipykernel's. The notebook's half,
which forwards prompts and answers, is :mod:`.stdin`.
"""

from __future__ import annotations

import logging
import types
from typing import Any

logger = logging.getLogger(__name__)


class StdinPolicy:
    """A rank kernel's ``input()``/``getpass()``: refused, saying why, where the relay said this
    cell may not read stdin (a mixin before ipykernel's kernel class, whose methods it wraps)."""

    _allow_stdin: bool
    shell: Any

    def raw_input(self, prompt: str = "") -> str:
        why = self._no_stdin()
        if why:
            raise self._stdin_refused(why)
        return super().raw_input(prompt)  # type: ignore[misc]

    def getpass(self, prompt: str = "", stream=None, **kwargs):  # type: ignore[no-untyped-def]
        why = self._no_stdin()
        if why:
            raise self._stdin_refused(why)
        return super().getpass(prompt, stream, **kwargs)  # type: ignore[misc]

    def _stdin_refused(self, why: str) -> BaseException:
        """The StdinNotImplementedError a refused ``input()`` raises, rendered without this
        module's frames: the rank's traceback ends at the user's ``input()`` line.

        ``__tracebackhide__`` cannot do it: IPython (9.x ultratb) never hides the frame an
        exception was raised in, and that frame is ``raw_input`` here. IPython's showtraceback
        uses an exception's ``_render_traceback_`` instead of its own formatting when there
        is one, so the error carries one that formats the traceback minus our frames with
        the shell's own formatter (same colours, same ``Cell In[n]`` lines). The type stays
        StdinNotImplementedError, which user code may catch."""
        from IPython.core.error import StdinNotImplementedError

        error = StdinNotImplementedError(why)
        shell = self.shell

        def render() -> list[str]:
            tb = _without_own_frames(error.__traceback__)
            return shell.InteractiveTB.structured_traceback(type(error), error, tb)

        error._render_traceback_ = render  # type: ignore[attr-defined]
        return error

    def _no_stdin(self) -> str | None:
        """Why this cell may not read stdin, when the relay said (clorch_repl.session.stdin's
        NO_STDIN_KEY: the rank is not in --stdin-ranks, or the notebook's front end takes no
        input): said instead of ipykernel's "this frontend does not support input requests"."""
        if self._allow_stdin:
            return None
        from .stdin import NO_STDIN_KEY

        return (self.get_parent("shell").get("metadata") or {}).get(NO_STDIN_KEY)  # type: ignore[attr-defined]


def _without_own_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` with the frames of this module left out (a new chain; the frames are the same)."""
    kept: list[types.TracebackType] = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            kept.append(tb)
        tb = tb.tb_next
    chain: types.TracebackType | None = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain
