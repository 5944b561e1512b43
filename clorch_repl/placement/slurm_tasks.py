"""Where one task of an srun step is, read from Slurm's variables: the one reader of them.

Every process srun starts learns its place from the environment slurmstepd gives it: a session's
nanny (:func:`clorch_repl.wire.rank_env.read_identity`) and a batch job's rank
(:mod:`clorch_repl.jobs._rank_entry`, through the same function). Slurm counts tasks per node in a
compressed form (``SLURM_STEP_TASKS_PER_NODE=2(x3),1``: three nodes of two tasks, then one of
one), which :func:`tasks_per_node` expands.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Mapping

from ..errors import ConfigError

logger = logging.getLogger(__name__)

#: The variable whose presence says "a task of an srun step".
PROCID = "SLURM_PROCID"


@dataclass(frozen=True)
class TaskPlace:
    """A task's place in its step, in torchrun's terms."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def tasks_per_node(spec: str, node: int) -> int:
    """Slurm's compressed task counts, e.g. ``"2(x3),1"``: the count of node ``node``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ConfigError(f"cannot read SLURM_STEP_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE={spec!r}")
    return counts[node]


def task_place(env: Mapping[str, str]) -> TaskPlace | None:
    """The task's place from Slurm's variables (the step's own counts before the allocation's),
    None where this process is no srun task. KeyError or ValueError for variables that are
    missing or not numbers (the caller says which launcher's variables it could not read)."""
    if PROCID not in env:
        return None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    return TaskPlace(rank=int(env[PROCID]), local_rank=int(env.get("SLURM_LOCALID", "0")),
                     world_size=int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
                     local_world_size=tasks_per_node(per_node, int(env.get("SLURM_NODEID", "0"))))
