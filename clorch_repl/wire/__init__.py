"""The contract between the notebook's side and a rank's side: what crosses from one process to the
other, in one package both sides import, in the manner of jupyter_client's one versioned message
module that kernel and client share.

- :mod:`.framing`: the Jupyter wire format of the relay's requests and the ranks' replies (the
  lean frame, signatures, the message keys each side reads).
- :mod:`.limits`: a cell's output limits and the budget that keeps them (the notebook sends the
  limits with each cell; each rank keeps its share at the source).
- :mod:`.values`: what a value pulled from or pushed to ranks may be, and how it is written and read.
- :mod:`.requests`: the one line a notebook's request to a rank is written as (its parser and
  handlers are the rank's, :mod:`clorch_repl.kernel.requests`).
- :mod:`.probe`: the control-channel question "where are you" and its answer's names.
- :mod:`.nanny`: what a remote rank's nanny and the notebook's callback endpoint say.
- :mod:`.connect`: how a nanny finds the notebook (the connect info, its variables, the heartbeat).
- :mod:`.rank_env`: every rank's environment, written by the notebook's launchers, the nannies and
  batch jobs alike, and read by the rank.
- :mod:`.results`: a batch job's rank result file, written by the rank, read by the job's monitor.

Why one package: the rank's side (``clorch_repl.kernel``) used to import these from the notebook's
(``clorch_repl.session``), so the two could not be told apart and a change on one side could
silently change the other. Now the rank's side imports nothing of the notebook's
(tests/unit/test_layout.py holds both to that), and whatever they share is here.

The contract has one version, :data:`PROTOCOL_VERSION`. It is checked where the other side
connects: a nanny's registration and its connect file (:mod:`.nanny`), and a rank's join of its
group (the notebook sends its version with the ``join`` request; the rank refuses another one with
:class:`clorch_repl.errors.ProtocolMismatch`). Raise it whenever anything here changes meaning. This
module imports nothing of clorch_repl: every side, :mod:`clorch_repl.errors` included, may import it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PROTOCOL_VERSION", "mismatch"]

#: The version of the contract (1-5 were the nanny protocol's alone: 1 issue 12's first multi-host
#: session, unchecked; 2 checked; 3 the rank's kernel is ``clorch_repl.kernel.app`` and requests are
#: named handlers; 4 the lean reply frame; 5 the nanny's CUDA ``checkpoint``. 6: one contract for
#: nannies and ranks, this package; a rank checks it when it joins).
PROTOCOL_VERSION = 6


def mismatch(theirs: Any, whose: str, what_to_do: str = "install the same clorch_repl version on every host") -> str | None:
    """Why ``whose`` (a connect file, a nanny, the notebook), speaking version ``theirs``, cannot be
    talked to, naming both versions and ``what_to_do``; None when it can."""
    if theirs == PROTOCOL_VERSION:
        return None
    said = "no protocol version (a clorch_repl from before the version was checked)" if theirs is None else \
        f"protocol {theirs!r}"
    return f"{whose} speaks {said}, this clorch_repl speaks protocol {PROTOCOL_VERSION}: {what_to_do}"
