"""The notebook's :class:`~clorch_repl.session.hooks.SessionHooks`: what a session driven from a
notebook kernel gets between cells (the ranks' widgets in the front end, the kernel reading busy
while a cell runs, a bounded IPython history of relayed text, JupyterLab's debugger panel).

Why a class of its own: the session imports no IPython (scripts, the release check and agents
drive it too), so everything that needs the notebook kernel is asked of these hooks.
"""

from __future__ import annotations

import logging
from typing import Any, ContextManager

from ..session import flood_guard
from ..session.hooks import SessionHooks, Verbs, WidgetHook
from .comms import CommBridge, notebook_kernel
from .debugger import DebugForwarder
from .kernel_status import busy_during

logger = logging.getLogger(__name__)


class NotebookHooks(SessionHooks):
    """A session's hooks inside the notebook kernel (see the module docstring)."""

    #: the engine's refusals name the magics the notebook's user types
    verbs = Verbs(interrupt="%clorch interrupt", restart="%clorch restart",
                  restart_ranks="%clorch restart --ranks {ranks}", to_start="run %clorch start",
                  ranks="--ranks", stdin_ranks="--stdin-ranks", timeout="--timeout", hang_notice="--hang-notice",
                  stdin_refused=("only {allowed} may read input in this cell (%%distributed --stdin-ranks); add rank "
                                 "{rank} there to answer its prompts from the notebook"),
                  restart_some="%clorch restart --ranks", start="%clorch start", stop="%clorch stop",
                  status="%clorch status", suspend="%clorch suspend", resume="%clorch resume", why="%clorch why",
                  why_ranks="--rank", debugger="%clorch debugger", logs="logs")
    #: the notebook numbers its users' cells itself (each %%distributed cell's [n]); its own
    #: requests without a number (%clorch debug) go unnumbered, as before (see SessionHooks)
    numbers_cells = True

    def __init__(self) -> None:
        #: the notebook cells whose relayed text IPython's history keeps (see bound_cell_history)
        self.relayed_cells: list[int] = []

    def widgets(self, relay: Any) -> WidgetHook | None:
        """A bridge of the ranks' comms into the notebook kernel's comm manager (see .comms)."""
        return CommBridge(relay)

    def waiting(self) -> ContextManager[None]:
        """The notebook kernel reports busy while a cell is waited for (see .kernel_status)."""
        return busy_during(notebook_kernel())

    def notice(self, text: str) -> None:
        print(text)  # on stdout, above the cell's output: information, not an error

    def cell_ended(self, cell_number: int | None) -> None:
        bound_cell_history(cell_number, self.relayed_cells)

    def debugger(self, rank_handle: Any, rank: int) -> DebugForwarder:
        return DebugForwarder.for_notebook(rank_handle, rank)


def bound_cell_history(cell_number: int | None, relayed: list[int]) -> None:
    """Keep IPython's record of a ``%%distributed`` cell's relayed text bounded
    (:func:`clorch_repl.session.flood_guard.bound_history`); ``relayed``: the session's list of
    such cells.

    The record is keyed by the cell's own number (``[12]``, what IPython's output capture
    read when the cell began), not by ``shell.execution_count``, which IPython has already
    moved on to the next cell's number while this one runs: keyed by that, the bound cut an
    empty record and the notebook kept every cell's output (34 MB over 120 cells of 3,000
    lines a rank)."""
    from IPython.core.getipython import get_ipython

    shell = get_ipython()
    history = getattr(shell, "history_manager", None)
    outputs = getattr(history, "outputs", None)
    if outputs is None:
        return
    if cell_number is None:
        result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
        cell_number = getattr(result, "execution_count", None)
    if cell_number is None:
        cell_number = shell.execution_count - 1
    flood_guard.bound_history(outputs, int(cell_number), relayed=relayed,
                              exceptions=getattr(history, "exceptions", None))
