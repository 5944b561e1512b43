"""The rows of ``%clorch status``: each rank's state, process, device and what it uses."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from ..launchers.base import Launcher
from ..topology import Topology
from .protocol import RankState


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


def rank_reports(group: Launcher, busy: Iterable[int], topology: Topology, *, starting: bool) -> list[RankReport]:
    """Every rank of ``group`` as ``%clorch status`` shows it (``busy``: ranks running a request)."""
    busy = set(busy)
    usage = group.memory()
    now = time.time()
    rows = []
    for proc in group.ranks:
        alive = proc.alive
        rss, gpu = usage.get(proc.rank, (None, None)) if alive else (None, None)
        if not alive:
            state = RankState.DEAD
        elif starting:
            state = RankState.STARTING
        else:
            state = RankState.BUSY if proc.rank in busy else RankState.IDLE
        rows.append(RankReport(
            rank=proc.rank, state=state, pid=proc.pid, host=proc.host, device=topology.device_label(proc.rank),
            backend=topology.backend, memory_bytes=rss, gpu_memory_bytes=gpu,
            uptime_s=now - proc.started_at if alive else 0.0, exit=proc.exit))
    return rows
