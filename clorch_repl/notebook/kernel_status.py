"""The notebook kernel's status stays ``busy`` until a ``%%distributed`` cell ends.

Why: ipykernel answers control-channel requests (JupyterLab's debugger asks ``debug_request``;
Jupyter Server nudges with ``kernel_info_request`` when a page reconnects) on its control thread
while the cell runs, and publishes ``busy`` then ``idle`` for each on iopub. JupyterLab's status
bar takes any status message for the kernel's state, so a cell of widgets (tqdm bars moving for a
minute) read "Idle" while it still ran (jupyter/jupyter_client#838, jupyterlab#10701). While a
``%%distributed`` cell runs, a control request's ``idle`` is published as ``busy``: the kernel is
busy, and the cell's own ``idle`` (on the shell channel) still says when it ends.

:func:`published_status` decides (pure); :func:`busy_during` holds it for the length of a cell.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = ["published_status", "busy_during"]

#: set while a %%distributed cell runs (read on the kernel's control thread)
_CELL_RUNNING = threading.Event()
#: the kernels whose status publishing is wrapped (once each)
_WRAPPED: set[int] = set()


def published_status(status: str, channel: str, cell_running: bool) -> str:
    """The execution state to publish for a request's ``status`` on ``channel``: a control
    request ending while a cell runs does not make the kernel idle."""
    if cell_running and channel == "control" and status == "idle":
        return "busy"
    return status


def _wrap(kernel: Any) -> None:
    """Route ``kernel._publish_status`` through :func:`published_status` (once per kernel)."""
    if id(kernel) in _WRAPPED or not callable(getattr(kernel, "_publish_status", None)):
        return
    original = kernel._publish_status

    def publish(status: str, channel: str, parent: Any = None) -> None:
        original(published_status(status, channel, _CELL_RUNNING.is_set()), channel, parent)

    kernel._publish_status = publish
    _WRAPPED.add(id(kernel))


@contextlib.contextmanager
def busy_during(kernel: Any | None) -> Iterator[None]:
    """While the block runs (a ``%%distributed`` cell), ``kernel`` (the notebook's ipykernel;
    None in a terminal IPython: nothing to do) reports busy to every status message."""
    if kernel is None:
        yield
        return
    _wrap(kernel)
    _CELL_RUNNING.set()
    try:
        yield
    finally:
        _CELL_RUNNING.clear()
