"""A rank's own half of stdin: ``input()`` and ``getpass()`` in a rank kernel, refused with the
reason where the relay said this cell may not read stdin (the rank is not in ``--stdin-ranks``,
or the notebook's front end takes no input), and otherwise ipykernel's. The notebook's half,
which forwards prompts and answers, is :mod:`clorch_repl.session.stdin`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..wire.framing import NO_STDIN_KEY, NO_STDIN_RANK
from . import tracebacks
from .tracebacks import interrupts_at_users_line, shown_without

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

    # Kernel > Interrupt while a rank waits in input(): the traceback ends at the user's line and
    # ipykernel's own frames, as in a plain kernel, without this module's
    raw_input = interrupts_at_users_line(raw_input, __file__)  # type: ignore[assignment]
    getpass = interrupts_at_users_line(getpass, __file__)  # type: ignore[assignment]

    def _stdin_refused(self, why: str) -> BaseException:
        """The StdinNotImplementedError a refused ``input()`` raises, shown without this module's
        frames (:mod:`.tracebacks`): the rank's traceback ends at the user's ``input()``
        line. The type stays StdinNotImplementedError, which user code may catch."""
        from IPython.core.error import StdinNotImplementedError

        # (this module's frames, and those of the wrapper that shows an interrupt here at the user's line)
        return shown_without(StdinNotImplementedError(why), self.shell, (__file__, tracebacks.__file__))

    def _no_stdin(self) -> str | None:
        """Why this cell may not read stdin, when the relay said (clorch_repl.wire.framing's
        NO_STDIN_KEY: the rank is not in --stdin-ranks, or the notebook's front end takes no
        input): said instead of ipykernel's "this frontend does not support input requests"."""
        if self._allow_stdin:
            return None
        why = (self.get_parent("shell").get("metadata") or {}).get(NO_STDIN_KEY)  # type: ignore[attr-defined]
        if not isinstance(why, str):
            return None
        return why.replace(NO_STDIN_RANK, os.environ.get("RANK", "?"))  # one text for every rank
