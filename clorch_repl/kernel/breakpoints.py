"""What a rank's kernel adds so that Python's debugging habits work on a rank from the notebook.

``breakpoint()``: ipykernel imports debugpy, which replaces ``sys.breakpointhook`` with one that
does nothing unless a debug client (JupyterLab's debugger panel) is attached, so in a plain
ipykernel ``breakpoint()`` is silently skipped. On a rank it opens pdb instead, at the caller's
line, whose prompts reach the notebook through the cell's stdin path (clorch_repl.session.stdin);
when a debug client is attached, debugpy's hook runs as before. ``PYTHONBREAKPOINT`` is honoured
as Python honours it (``0`` turns breakpoint() off, a dotted name picks another debugger).

On a rank that may not read input in this cell (not in ``%%distributed --stdin-ranks``, or a front
end that takes none, as nbclient's), ``breakpoint()`` is skipped with one line saying why, as a
plain ipykernel skips it without a debugger: pdb printed its frame header there (merged with the
rank that does debug, as if both had stopped) and then failed its first prompt with a forty-line
traceback through ``bdb``, ``pdb`` and ``cmd`` (a try-out).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)


def breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """``sys.breakpointhook`` of a rank (see the module docstring)."""
    if os.environ.get("PYTHONBREAKPOINT"):
        return sys.__breakpointhook__(*args, **kwargs)
    debugpy = sys.modules.get("debugpy")
    if debugpy is not None:
        try:
            attached = debugpy.is_client_connected()
        except Exception as exc:  # noqa: BLE001 - a debugpy without this API: fall back to pdb
            logger.debug("debugpy.is_client_connected failed: %s", exc)
            attached = False
        if attached:
            return debugpy.breakpoint()
    if (why := _no_stdin()) is not None:
        print(why, file=sys.stderr, flush=True)
        return None
    import pdb

    pdb.Pdb().set_trace(sys._getframe(1))  # the frame that called breakpoint()
    return None


def _no_stdin() -> str | None:
    """The line that says why this rank skips ``breakpoint()`` (see the module docstring), or None
    where its prompts may reach the notebook."""
    from IPython.core.getipython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    why = kernel._no_stdin() if hasattr(kernel, "_no_stdin") else None  # clorch_repl.kernel.stdin_policy
    if why is None:
        return None
    _, sep, rest = why.partition(": ")  # "input() on rank 1: only rank 0 may read input ..."
    if not sep:
        return f"breakpoint() skipped: {why}"
    asks, said, _ = rest.rpartition(" to answer its prompts")  # (the driver's words end it: Verbs.stdin_refused)
    rest = f"{asks} to debug it too" if said else rest
    return f"breakpoint() skipped on rank {os.environ.get('RANK', '?')}: {rest}"


def install() -> None:
    """Make ``breakpoint()`` on this rank open pdb (see the module docstring)."""
    sys.breakpointhook = breakpointhook
