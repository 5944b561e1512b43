"""What a cell's execute_request carries to its ranks, packed once for all of them (the relay
signs and sends it per rank, see :meth:`clorch_repl.session.relay.Relay.begin`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..common import env_vars
from ..common.rank_sets import rank_words
from .cell_run import CellRun
from .hooks import SCRIPT_VERBS
from .protocol import CellRequest
from .stdin import StdinBroker
from ..wire.framing import (CELL_NUMBER_KEY, COMPACT_REPLY_KEY, LEAN_KEY, NO_STDIN_KEY, NO_STDIN_RANK,
                            OUTPUT_LIMITS_KEY, pack)


#: a request made without the session's rules (a test's, a tool's): the engine's own words
DEFAULT_STDIN_REFUSED = SCRIPT_VERBS.stdin_refused


def packed_request(request: CellRequest, silent: bool, allowed: bool, front: bool,
                   no_front: str) -> tuple[bytes, bytes]:
    """(metadata, content) of the cell's request, packed; allow_stdin only where its prompts
    can reach the front end (see clorch_repl.session.stdin); otherwise the rank's kernel
    raises with the reason. The ranks reply in the compact form (wire.COMPACT_REPLY_KEY) unless
    ``CLORCH_COMPACT_REPLIES=0`` (read per cell: ``benchmarks/relay_cost.py --ab-compact``
    alternates the two in one session)."""
    content = dict(code=request.code, silent=silent, store_history=not silent, user_expressions={},
                   allow_stdin=allowed, stop_on_error=False)
    metadata: dict[str, Any] = {LEAN_KEY: True}
    if env_vars.COMPACT_REPLIES.get() != "0":
        metadata[COMPACT_REPLY_KEY] = True
    if request.output_limits is not None:
        metadata[OUTPUT_LIMITS_KEY] = request.output_limits.to_wire()
    if request.cell_number is not None and not silent:
        metadata[CELL_NUMBER_KEY] = int(request.cell_number)
    if not allowed:
        rank = NO_STDIN_RANK
        why = no_front if not front else (request.stdin_refused or DEFAULT_STDIN_REFUSED).format(
            allowed=rank_words(request.stdin_ranks or ()), rank=rank)
        metadata[NO_STDIN_KEY] = f"input() on rank {rank}: {why}"
    return pack(metadata), pack(content)


@dataclass(frozen=True)
class StartedCell:
    """The handle of a cell :meth:`Relay.begin` sent to its ranks, for :meth:`Relay.finish` to wait
    for: every way a cell begins (the magic, :meth:`Session.run`, the head start, clorch's own
    requests) gets one, so what a Ctrl-C during the send means is decided in one place."""

    request: CellRequest
    run: CellRun
    stdin: StdinBroker
    #: Kernel > Interrupt came while the cell was being sent: every rank has it, and
    #: :meth:`Relay.finish` ends it as interrupted (the ranks are interrupted at once, their
    #: output shown), rather than the interrupt escaping and leaving the cell begun, unread
    interrupted: bool = False
