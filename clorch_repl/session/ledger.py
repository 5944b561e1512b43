"""What the notebook knows of every rank's requests across cells, and where each message goes (pure).

Why apart from the sockets: which request a message belongs to decides whether it is shown,
counted against a cell's end, held for the next cell, or dropped and counted as the late output
of a cell that was cut short; a mistake here wedges a cell or mixes one cell's output into
another's. The :class:`Ledger` takes decoded messages (rank, channel, message, time) and answers
with :data:`Effect` values the relay carries out; the running cell's own book-keeping is its
:class:`~clorch_repl.session.cell_run.CellRun`. No socket, no clock, no process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..common.human import COLUMNS, wrap
from .cell_run import OUTPUT_TYPES, CellRun
from .protocol import RankOutput
from ..wire.framing import COUNTED_KEY, IOPUB_COUNT_KEY

logger = logging.getLogger(__name__)

#: Comm message types (widgets), forwarded in both directions and never dropped.
COMM_TYPES = frozenset({"comm_open", "comm_msg", "comm_close"})

#: Per rank, how many abandoned requests are remembered so that their late output is dropped. An
#: entry goes once its reply and every message the reply counts (or its idle status) came; one
#: whose messages were lost (the flood case) would stay for ever, so only the most recent are
#: kept: a backlog older than that many cells is long gone.
ABANDONED_KEPT = 64


@dataclass(frozen=True)
class Show:
    """Give ``item`` to the running cell's sink."""

    item: RankOutput


@dataclass(frozen=True)
class CommMessage:
    """A rank's comm message (a widget's): to the comm sink, through the cell's sink when
    ``in_cell`` (so it keeps its place among the rank's output), at once otherwise."""

    rank: int
    msg: dict[str, Any]
    in_cell: bool


@dataclass(frozen=True)
class DebugEvent:
    """A rank's debug_event: to the debugger's sink (%clorch debugger), if one is set."""

    rank: int
    msg: dict[str, Any]


@dataclass(frozen=True)
class InputRequest:
    """A rank of the running cell asks for a line: the cell's stdin broker serves it."""

    rank: int
    msg: dict[str, Any]


@dataclass(frozen=True)
class EndOfFile:
    """A rank asked for a line outside a cell (a thread of an earlier one): no one can answer;
    it gets end-of-file rather than hang."""

    rank: int


Effect = Show | CommMessage | DebugEvent | InputRequest | EndOfFile


class Ledger:
    """Every rank's requests as far as the notebook knows them, and the routing of messages."""

    def __init__(self) -> None:
        #: msg_id of the request each rank is still executing (None when idle as far as we know)
        self.running: dict[int, str | None] = {}
        #: output of an earlier cell that arrived between cells, shown with the next one
        self.late: list[RankOutput] = []
        #: per rank, msg_ids of cells whose wait ended before they were finished (timed out,
        #: stuck, drained after the reply): their later output is dropped, not shown elsewhere.
        #: Each with [iopub messages read, the count its reply gave or None]; insertion-ordered
        self.abandoned: dict[int, dict[str, list[int | None]]] = {}
        #: per rank, [messages, characters] of such output dropped since the last notice
        self.dropped: dict[int, list[int]] = {}
        #: per rank, the msg_id of a request that is no cell (a front end's comm message) being settled
        self.settling: dict[int, str] = {}
        #: ranks the debugger panel has paused (stopped, not yet continued): held, not hung
        self.debug_paused: set[int] = set()

    def add_rank(self, rank: int) -> None:
        self.running[rank] = None

    def busy(self) -> list[int]:
        """Ranks still executing an earlier request, as far as what was read says."""
        return [r for r, msg_id in self.running.items() if msg_id is not None]

    def idle(self, rank: int) -> bool:
        return self.running.get(rank) is None

    def take_late(self) -> list[RankOutput]:
        """What arrived between cells, for the next cell to show first."""
        late, self.late = self.late, []
        return late

    # ------------------------------------------------------------------------------ iopub
    def iopub(self, rank: int, msg: dict[str, Any], cell: CellRun | None, now: float) -> list[Effect]:
        """One iopub message: routed, and, when the rank counted it (wire.COUNTED_KEY), counted
        against the count its request's reply gives (wire.IOPUB_COUNT_KEY)."""
        parent_id = msg["parent_header"].get("msg_id")
        effects = self._route(rank, msg, cell, now)
        if not msg["metadata"].get(COUNTED_KEY):
            return effects
        if cell is not None and cell.counted(rank, parent_id):
            return effects
        entry = self.abandoned.get(rank, {}).get(parent_id or "")
        if entry is not None:
            entry[0] = (entry[0] or 0) + 1
            if entry[1] is not None and entry[0] >= entry[1]:  # nothing more comes of it
                del self.abandoned[rank][parent_id]
        return effects

    def _route(self, rank: int, msg: dict[str, Any], cell: CellRun | None, now: float) -> list[Effect]:
        msg_type = msg["header"]["msg_type"]
        parent_id = msg["parent_header"].get("msg_id")
        content = msg["content"]
        if msg_type == "status":
            if content.get("execution_state") == "idle":
                self._idle(rank, parent_id, cell)
            return []
        if msg_type == "debug_event":  # JupyterLab's debugger on a rank (clorch_repl.notebook.debugger)
            event = content.get("event")
            if event == "stopped":
                self.debug_paused.add(rank)
                if cell is not None:
                    cell.last_progress = now
            elif event in ("continued", "terminated", "exited"):
                self.debug_paused.discard(rank)
            return [DebugEvent(rank, msg)]
        if msg_type in COMM_TYPES:  # widgets: never dropped, whichever request they belong to
            if cell is not None:
                cell.last_progress = now  # a widget bar moving is progress: no hang notice
                cell.heard_from(rank, parent_id, now)
            return [CommMessage(rank, msg, cell is not None)]
        if msg_type in OUTPUT_TYPES and parent_id in self.abandoned.get(rank, {}):
            self._drop(rank, content)
            return []
        if cell is None:
            if msg_type in OUTPUT_TYPES:
                self.late.append(RankOutput(rank, msg_type, content))
            return []
        cell.heard_from(rank, parent_id, now)
        if msg_type in OUTPUT_TYPES:
            # Output of an earlier cell that ended normally (a thread it started) is shown too.
            item = cell.output(rank, msg_type, content, parent_id, now)
            return [] if item is None else [Show(item)]
        if msg_type == "error" and cell.mine(rank, parent_id):
            cell.error(rank, content, now)
        return []

    def _idle(self, rank: int, parent_id: str | None, cell: CellRun | None) -> None:
        if cell is None or not cell.idle(rank, parent_id):
            if parent_id == self.running.get(rank):
                self.running[rank] = None
        self.abandoned.get(rank, {}).pop(parent_id or "", None)  # nothing more comes of it
        if self.settling.get(rank) == parent_id:
            del self.settling[rank]

    def _drop(self, rank: int, content: dict[str, Any]) -> None:
        """Output of an abandoned cell, arriving after its wait ended, is dropped and counted.

        Why not show it, labelled late, in whichever cell runs next: it belongs to a cell the
        user has already been told was cut short, mixing it into another cell's output makes
        that cell's output wrong, and under a flood there can be megabytes of it. Nothing is
        lost: the rank's log holds all of it, and the next cell ends with one line saying how
        much was dropped and where to read it."""
        counts = self.dropped.setdefault(rank, [0, 0])
        counts[0] += 1
        counts[1] += len(str(content.get("text", ""))) + len(str(content.get("data", "")))

    # ------------------------------------------------------------------------ shell, stdin
    def reply(self, rank: int, msg: dict[str, Any], cell: CellRun | None, now: float) -> None:
        """A shell reply: an execute_reply says the rank finished the request; its error, if
        any, stands in for an iopub error message that may have been dropped."""
        if msg["msg_type"] != "execute_reply":
            return
        parent_id = msg["parent_header"].get("msg_id")
        count = msg["metadata"].get(IOPUB_COUNT_KEY)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            count = None  # ipykernel's own path answered: its idle status ends the rank's part
        if cell is not None and cell.reply(rank, parent_id, count, msg["content"], now):
            return
        if parent_id is not None and parent_id == self.running.get(rank):
            self.running[rank] = None  # an abandoned cell's request is done: the rank is free
        entry = self.abandoned.get(rank, {}).get(parent_id or "")
        if entry is not None and count is not None:
            entry[1] = count
            if (entry[0] or 0) >= count:  # nothing more comes of it
                del self.abandoned[rank][parent_id]

    def input_request(self, rank: int, msg: dict[str, Any], cell: CellRun | None, now: float) -> list[Effect]:
        """A rank asks for a line: the running cell's broker serves it, if the rank runs in it."""
        if msg["msg_type"] != "input_request":
            return []
        if cell is not None and rank in cell.pending:
            cell.answered_prompt(now)
            return [InputRequest(rank, msg)]
        logger.warning("rank %d asked for input outside a cell; answered with end-of-file", rank)
        return [EndOfFile(rank)]

    # ----------------------------------------------------------------------------- the end
    def end(self, cell: CellRun) -> list[RankOutput]:
        """The cell's wait is over: requests that did not finish are abandoned (their later
        output is dropped and counted, see :meth:`_drop`). Returns the lines that end the cell:
        what the notebook's guard held back, and what was dropped of earlier cells."""
        self.debug_paused.difference_update(cell.msg_ids)  # a rank whose cell ended is not paused in it
        for rank, msg_id in cell.msg_ids.items():
            if rank not in cell.finished:
                abandoned = self.abandoned.setdefault(rank, {})
                abandoned[msg_id] = [cell.received.get(rank, 0), cell.expected.get(rank)]
                while len(abandoned) > ABANDONED_KEPT:  # the idle of the oldest was lost: forget it
                    del abandoned[next(iter(abandoned))]
        lines = cell.withheld_lines()
        for rank in sorted(self.dropped):
            count, size = self.dropped.pop(rank)
            text = (f"(clorch_repl: dropped {count} late output message(s), {size / 1024:.0f} KiB, of an earlier "
                    f"cell that was cut short or whose end was never confirmed; the rank's log has them: "
                    f"%clorch logs {rank})")
            # shown as the rank's lines, each under its label (``[rank 3] ``): wrapped to fit beside it
            text = wrap(text, width=COLUMNS - len(f"[rank {rank}] "), indent="  ")
            lines.append(RankOutput(rank, "stream", {"name": "stdout", "text": text + "\n"}))  # a notice: not on red
        return lines
