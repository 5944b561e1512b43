"""Batch-job mains for the multi-host tests (imported by ranks on the simulated hosts)."""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist


def where(ctx: dict[str, Any]) -> dict[str, Any]:
    """Every rank's place and host, and an all_reduce across the hosts."""
    t = torch.tensor([float(ctx["rank"] + 1)])
    dist.all_reduce(t)
    return {"rank": ctx["rank"], "local_rank": ctx["local_rank"], "world_size": ctx["world_size"],
            "host": socket.gethostname(), "sum": t.item()}


def fail_on_last(ctx: dict[str, Any]) -> None:
    if ctx["rank"] == ctx["world_size"] - 1:
        raise ValueError(f"rank {ctx['rank']} fails on {socket.gethostname()}")
    dist.barrier()
