"""What ``%clorch top`` shows: one row per rank from what the feed saw, as a text and an HTML
table. Pure functions of plain data (:class:`RankSnapshot`), so what is shown is tested without
any process; :mod:`.panel` gathers the snapshots and updates the display.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from typing import Any

from ..human import duration as _duration
from ..human import size as _bytes

__all__ = ["RankSnapshot", "Collective", "rows", "render"]

COLUMNS = ("rank", "host", "state", "cell", "for", "last line", "cpu", "memory", "gpu", "gpu memory",
           "collective")
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


def _state(snap: RankSnapshot) -> str:
    if not snap.alive:
        return f"dead ({snap.exit})" if snap.exit else "dead"
    if not snap.answered:
        return "busy, not answering" if snap.busy else "not answering"
    return "busy" if snap.busy else "idle"


def _collective(c: Collective | None) -> str:
    if c is None:
        return "-"
    what = f"{c.op} #{c.seq}" if c.op else f"#{c.seq}"
    stuck = " STUCK" if c.age_s >= STUCK_AFTER_S else ""
    return f"{what} ({c.group}) for {_duration(c.age_s)}{stuck}"


def rows(snapshots: list[RankSnapshot]) -> list[list[str]]:
    """One row of strings per rank, in rank order, columns as :data:`COLUMNS`."""
    out = []
    for snap in sorted(snapshots, key=lambda s: s.rank):
        use = snap.usage or {}
        gpu = use.get("gpu") or {}
        cpu = use.get("cpu_pct")
        line = (snap.last_line or "").strip()
        if len(line) > LAST_LINE_CHARS:
            line = line[:LAST_LINE_CHARS - 1] + "…"
        out.append([str(snap.rank), snap.host or "here", _state(snap), snap.cell or "-",
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
    text = "\n".join([head, fmt.format(*COLUMNS), *(fmt.format(*r) for r in body)]
                     + ([f"hang: {verdict}"] if verdict else []))
    cells = "".join("<tr>" + "".join(f"<td style='text-align:left;padding:0 6px'>{html.escape(c)}</td>" for c in r)
                    + "</tr>" for r in body)
    header = "".join(f"<th style='text-align:left;padding:0 6px'>{html.escape(h)}</th>" for h in COLUMNS)
    verdict_html = (f"<div style='color:#b00'><b>hang:</b> {html.escape(verdict)}</div>" if verdict else "")
    page = (f"<div class='clorch-top'><div><b>{html.escape(head)}</b></div><table><thead><tr>{header}</tr>"
            f"</thead><tbody>{cells}</tbody></table>{verdict_html}</div>")
    return {"text/plain": text, "text/html": page}
