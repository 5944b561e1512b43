"""The rank's IPython shell, for the rank-side code that the notebook's requests run: values go
into and come out of its namespace, announcements go out through its display publisher."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def current_shell() -> Any | None:
    """The running kernel's shell, or None in a process without one (a benchmark that joins a
    group the way a rank does, from a plain script)."""
    from IPython import get_ipython

    return get_ipython()


def rank_shell(what: str) -> Any:
    """The running kernel's shell; ``what`` (the caller, for the message) needs one, and a
    process without a kernel (a script, a test) gets an error saying so."""
    shell = current_shell()
    if shell is None:
        raise RuntimeError(f"{what} runs inside a rank's kernel, and none runs in this process")
    return shell
