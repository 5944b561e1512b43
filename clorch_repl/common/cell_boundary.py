"""Where a rank's cell begins on its stack: the one rule every reader of a rank's stack cuts at.

A rank's main-thread stack, read from the outside in, is the kernel's own machinery (ipykernel's
dispatch, IPython's ``run_cell``) and then the user's cell. Everything outside the cell is the same
on every rank and in every dump, so the stuck-rank report (faulthandler's text dumps,
:mod:`clorch_repl.host.rankfiles`) and the live probe (frame records,
:mod:`clorch_repl.diagnosis.probe`) both cut where IPython's ``run_code`` calls the cell's code.
Both ask here, so that the two views of one rank never disagree on where its cell starts.

Standard library only: the nanny, the notebook and the rank all import it.
"""

from __future__ import annotations

import os

#: The frame that calls a cell's code: IPython's ``InteractiveShell.run_code``.
CALLER_FUNCTION = "run_code"
CALLER_FILE = os.path.join("IPython", "core", "interactiveshell.py")


def calls_the_cell(file: str, function: str) -> bool:
    """Whether a frame (its file and function) is the one that calls the cell's code."""
    return function == CALLER_FUNCTION and file.endswith(CALLER_FILE)


def dump_line_calls_the_cell(line: str) -> bool:
    """The same for a line of a faulthandler dump: ``  File "/.../IPython/core/interactiveshell.py",
    line 3577 in run_code``."""
    return f'{CALLER_FILE}"' in line and line.rstrip().endswith(f" in {CALLER_FUNCTION}")
