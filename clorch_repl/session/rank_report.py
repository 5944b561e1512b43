"""The rows of ``%clorch status``: each rank's state, process, device and what it uses (from the
session's read-only view, :mod:`.view`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .protocol import RankState
from .view import SessionView, uptime_s


@dataclass(frozen=True)
class RankReport:
    """One row of ``%clorch status``."""

    rank: int
    state: RankState
    pid: int | None
    #: the rank's host ("" for the notebook's own)
    host: str
    device: str
    backend: str
    memory_bytes: int | None
    gpu_memory_bytes: int | None
    uptime_s: float
    exit: str | None


def rank_reports(view: SessionView, usage: dict[int, tuple[int | None, int | None]]) -> list[RankReport]:
    """Every rank of the session's ``view`` as ``%clorch status`` shows it, with ``usage`` (rank ->
    resident and GPU memory, the launcher's answer) for the ranks alive."""
    now = time.time()
    rows = []
    for rank in view.ranks:
        rss, gpu = usage.get(rank.rank, (None, None)) if rank.alive else (None, None)
        rows.append(RankReport(
            rank=rank.rank, state=rank.state, pid=rank.pid, host=rank.host, device=rank.device,
            backend=view.backend, memory_bytes=rss, gpu_memory_bytes=gpu, uptime_s=uptime_s(rank, now),
            exit=rank.exit))
    return rows
