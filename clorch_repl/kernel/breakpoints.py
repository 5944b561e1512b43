"""What a rank's kernel adds so that Python's debugging habits work on a rank from the notebook.

``breakpoint()``: ipykernel imports debugpy, which replaces ``sys.breakpointhook`` with one that
does nothing unless a debug client (JupyterLab's debugger panel) is attached, so in a plain
ipykernel ``breakpoint()`` is silently skipped. On a rank it opens pdb instead, at the caller's
line, whose prompts reach the notebook through the cell's stdin path (clorch_repl.session.stdin);
when a debug client is attached, debugpy's hook runs as before. ``PYTHONBREAKPOINT`` is honoured
as Python honours it (``0`` turns breakpoint() off, a dotted name picks another debugger).
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
    import pdb

    pdb.Pdb().set_trace(sys._getframe(1))  # the frame that called breakpoint()
    return None


def install() -> None:
    """Make ``breakpoint()`` on this rank open pdb (see the module docstring)."""
    sys.breakpointhook = breakpointhook
