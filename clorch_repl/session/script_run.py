"""The notebook's half of ``%clorch run SCRIPT [ARGS...]`` / ``%clorch run -m MODULE [ARGS...]``.

Options go before the script, the script's own arguments after it, as torchrun takes them
(``%clorch run --ranks 0 train.py --ranks 5`` gives the script ``--ranks 5``); so ``--help`` is
``%clorch run``'s only before the script, and the script's after it.

Two requests (:func:`.requests.request_code`: the script's path and arguments travel as JSON data,
never as code), both through :meth:`Session.run` like every request to ranks: a silent pre-flight
asks every chosen rank whether it has the script and whether it compiles (a file missing on one node
would otherwise leave the other ranks waiting for it in their first collective until the group's
timeout), then the run itself is an ordinary cell, so its output, interrupts, ``--timeout``, hang
notices and death reports are a cell's. The rank's half is :mod:`clorch_repl.kernel.script`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import ClorchError, DistributedCellError, ScriptNotFound
from .hooks import NoStdin, ShowOutput, StdinHook, plain_output
from .protocol import CellOutcome
from ..wire.requests import request_code
from .session import Session

logger = logging.getLogger(__name__)

#: how long the pre-flight may take (a stat, or a module search on each rank)
CHECK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RunRequest:
    """One ``%clorch run`` as typed, validated."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    interactive: bool = False
    ranks: list[int] | None = None
    timeout_s: float | None = None
    hang_notice_s: float | None = None
    merge: bool = True

    def rank_code(self, check: bool = False) -> str:
        """The one line each rank runs: the pre-flight check, or the run."""
        if check:
            return request_code("script_check", script=self.script, module=self.module)
        return request_code("script_run", script=self.script, args=list(self.args), module=self.module,
                            interactive=self.interactive)


def run(session: Session, request: RunRequest, cell_number: int | None = None, *,
        show: ShowOutput = plain_output, stdin: StdinHook | NoStdin | None = None) -> CellOutcome:
    """Check that every chosen rank has the script, then run it there as a cell, its output to
    ``show``'s output hook and its prompts (``input()``, ``breakpoint()``) to ``stdin``, as a
    ``%%distributed`` cell's (None: nobody answers, the script's ``input()`` raises saying so)."""
    chosen = session.chosen(request.ranks)
    check = session.run(request.rank_code(check=True), request.ranks, CHECK_TIMEOUT_S,
                        show(chosen, hosts=session.hosts()), silent=True)
    if not check.ok:
        missing = all(o.error is not None and o.error.ename == "ScriptNotFound" for o in check.failed)
        error = ScriptNotFound if missing and check.failed else ClorchError
        raise error(f"%clorch run {request.script}: nothing was run: {DistributedCellError(check).summary()}")
    display = show(chosen, merge=request.merge, hosts=session.hosts())
    logger.debug("running %s on %s", request.script, chosen)
    return session.run(request.rank_code(), request.ranks, request.timeout_s, display,
                       hang_notice_s=request.hang_notice_s, cell_number=cell_number, stdin=stdin)
