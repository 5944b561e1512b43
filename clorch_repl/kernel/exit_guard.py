"""``exit()`` and ``quit()`` in a ``%%distributed`` cell, refused on the rank.

Why: in an IPython kernel they ask the kernel to end once the cell is over (``ask_exit``). A rank's
kernel that ends takes its rank out of the session's group: the cell reported success, and the
death showed only at a later cell, unexplained (a new user's try-out did exactly this, to "end the
script"). In a rank the cell now fails at the call, saying what ends ranks instead. A script run
with ``%clorch run`` keeps python's meaning of ``exit()`` (:mod:`.script` gives it its own), and
``sys.exit`` in a cell stays IPython's (an exception shown, the kernel kept).

IPython also follows a ``sys.exit`` in a cell with the warning "To exit: use 'exit', 'quit', or
Ctrl-D." — advice that would end a rank; that one warning of IPython's is silenced in ranks.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from ..errors import ClorchError
from . import tracebacks

logger = logging.getLogger(__name__)
tracebacks.hide_frames_of(__file__)

#: IPython's advice after a SystemExit in a cell (IPython.core.interactiveshell.run_code)
_IPYTHON_EXIT_ADVICE = r"To exit: use 'exit', 'quit', or Ctrl-D\."


class ExitRefused(ClorchError):
    """``exit()``/``quit()`` in a cell on a rank: it would end the rank's kernel."""


def install(shell: Any) -> None:
    """Make ``shell``'s ``exit()``/``quit()`` raise :class:`ExitRefused` instead of ending the kernel."""
    rank = os.environ.get("RANK", "?")

    def ask_exit() -> None:
        raise tracebacks.hide_own_frames(ExitRefused(
            f"exit() would end rank {rank}'s kernel and take it out of the session's group, so it is not done: "
            "the ranks keep running. %clorch stop ends every rank; to end a loop or a cell early, break or "
            "return (a script run with %clorch run may call exit())"))

    shell.ask_exit = ask_exit
    warnings.filterwarnings("ignore", message=_IPYTHON_EXIT_ADVICE, category=UserWarning)
