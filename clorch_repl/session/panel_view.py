"""What ``%clorch top`` shows: one row per rank from what the feed saw, as a text and an HTML
table. Pure functions of plain data (:class:`RankSnapshot`), so what is shown is tested without
any process; :mod:`.panel` gathers the snapshots and updates the display.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass
from typing import Any

from ..common.human import duration as _duration
from ..common.procs import exit_in_a_table
from ..common.human import size as _bytes

__all__ = ["RankSnapshot", "Collective", "rows", "render"]

COLUMNS = ("rank", "host", "state", "cell", "for", "last line", "cpu", "memory", "gpu", "gpu memory",
           "collective")
#: What each column means: the HTML table's header tooltips, and the legend under the text table
#: (a new user could not tell what ``(fr/0)`` or ``here`` meant).
LEGEND = {
    "host": "the machine the rank runs on; here: the notebook's own",
    "state": "busy: running a cell (also one whose wait ended with the rank stuck in it); idle; "
             "not answering: its Python is held by native code",
    "cell": "the cell the rank runs, and the line it is at now where its stack shows it",
    "for": "how long the rank has been running that cell",
    "last line": "the last line the rank wrote to its log (%clorch logs RANK has all of it)",
    "cpu": "the rank's CPU use (100 % is one core)",
    "memory": "the rank's resident memory",
    "gpu": "how busy the rank's GPU was over the last sample (NVML's utilisation; - on a CPU rank)",
    "gpu memory": "the memory in use on the rank's GPU, by every process on it, of its total",
    "collective": "the oldest collective the rank started and has not finished: its op, its number "
                  "in its process group (group 0 is the default group) and how long it has waited",
}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
#: A collective pending this long is shown as stuck (with the hang verdict when there is one).
STUCK_AFTER_S = 10.0
LAST_LINE_CHARS = 60


@dataclass(frozen=True)
class Collective:
    """The collective a rank has in flight: its group, op, sequence number and how long."""

    group: str
    seq: int
    op: str | None
    age_s: float


@dataclass(frozen=True)
class RankSnapshot:
    rank: int
    host: str
    alive: bool
    busy: bool
    exit: str | None = None
    cell: str | None = None
    cell_for_s: float | None = None
    last_line: str | None = None
    usage: dict[str, Any] | None = None
    collective: Collective | None = None
    answered: bool = True
    #: the line of the cell the rank is at now (``line 4: dist.barrier()``), where known
    line_now: str | None = None


def _state(snap: RankSnapshot) -> str:
    if not snap.alive:
        return f"dead ({exit_in_a_table(snap.exit)})" if snap.exit else "dead"
    if not snap.answered:
        return "busy, not answering" if snap.busy else "not answering"
    return "busy" if snap.busy else "idle"


def _collective(c: Collective | None) -> str:
    if c is None:
        return "-"
    what = f"{c.op} #{c.seq}" if c.op else f"#{c.seq}"
    stuck = " STUCK" if c.age_s >= STUCK_AFTER_S else ""
    group = c.group.rsplit("/", 1)[-1]  # the recorder's key ("fr/0"): its local number of the group
    return f"{what}, group {group}, for {_duration(c.age_s)}{stuck}"


def _shown_line(text: str | None) -> str:
    """A log line as a terminal would leave it: colour codes gone, only what the last carriage
    return left (a progress bar's last state)."""
    line = _ANSI.sub("", text or "").rstrip("\r").rsplit("\r", 1)[-1].strip()
    return line[:LAST_LINE_CHARS - 1] + "…" if len(line) > LAST_LINE_CHARS else line


def _cell(snap: RankSnapshot) -> str:
    """The cell's label (``[5] first line``), or where the rank is in it now (``[5] line 4: ...``)."""
    if not snap.cell:
        return "-"
    if not snap.line_now:
        return snap.cell
    number = snap.cell.split(" ", 1)[0] if snap.cell.startswith("[") else ""
    return f"{number} {snap.line_now}".strip()


def rows(snapshots: list[RankSnapshot]) -> list[list[str]]:
    """One row of strings per rank, in rank order, columns as :data:`COLUMNS`."""
    out = []
    for snap in sorted(snapshots, key=lambda s: s.rank):
        use = snap.usage or {}
        gpu = use.get("gpu") or {}
        cpu = use.get("cpu_pct")
        line = _shown_line(snap.last_line)
        out.append([str(snap.rank), snap.host or "here", _state(snap), _cell(snap),
                    _duration(snap.cell_for_s) if snap.cell else "-", line or "-",
                    f"{cpu:.0f} %" if isinstance(cpu, (int, float)) else "-", _bytes(use.get("rss")),
                    f"{gpu['util_pct']} %" if "util_pct" in gpu else "-",
                    f"{_bytes(gpu.get('memory_used'))} / {_bytes(gpu.get('memory_total'))}" if gpu else "-",
                    _collective(snap.collective)])
    return out


def render(snapshots: list[RankSnapshot], verdict: str | None = None, note: str | None = None,
           now: float | None = None) -> dict[str, str]:
    """The panel as a display bundle: ``text/plain`` and ``text/html``."""
    body = rows(snapshots)
    stamp = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    head = f"clorch top, {stamp}" + (f" ({note})" if note else "")
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(COLUMNS)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    legend = [f"  {name}: {meaning}" for name, meaning in LEGEND.items()]
    text = "\n".join([head, fmt.format(*COLUMNS), *(fmt.format(*r) for r in body)]
                     + ([f"hang: {verdict}"] if verdict else []) + ["columns:", *legend])
    cells = "".join("<tr>" + "".join(f"<td style='text-align:left;padding:0 6px;white-space:nowrap'>{html.escape(c)}</td>" for c in r)
                    + "</tr>" for r in body)
    header = "".join(f"<th style='text-align:left;padding:0 6px;white-space:nowrap' title='{html.escape(LEGEND.get(h, h), quote=True)}'>"
                     f"{html.escape(h)}</th>" for h in COLUMNS)
    legend_html = ("<details style='font-size:smaller'><summary>what the columns mean</summary>"
                   + "".join(f"<div><b>{html.escape(n)}</b>: {html.escape(m)}</div>" for n, m in LEGEND.items())
                   + "</details>")
    verdict_html = (f"<div style='color:#b00'><b>hang:</b> {html.escape(verdict)}</div>" if verdict else "")
    page = (f"<div class='clorch-top'><div><b>{html.escape(head)}</b></div><table><thead><tr>{header}</tr>"
            f"</thead><tbody>{cells}</tbody></table>{verdict_html}{legend_html}</div>")
    return {"text/plain": text, "text/html": page}
