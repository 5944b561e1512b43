"""clorch_repl.distributed: process groups, collectives on every backend, and batch jobs.

Collectives work in place and accept the ops ``sum avg min max band bor bxor prod`` on NCCL and
gloo alike (see :mod:`.collectives` for the routes taken where a backend lacks an op, and their
cost). ``launch`` starts a batch job (:mod:`clorch_repl.jobs`, whose :mod:`~clorch_repl.jobs.batch`
also keeps the registry behind ``%clorch jobs``; its names are kept here, as API.md spells them). ``save_checkpoint``/``load_checkpoint`` are training state and live in
:mod:`clorch_repl.training.checkpoint`, imported on first use; this package keeps API.md's names
for them. Its errors are in :mod:`clorch_repl.errors`.

The modules: :mod:`.group` (the process group's lifecycle), :mod:`.collectives` (the ops),
:mod:`.check` (check mode), :mod:`._c10d` (facts about torch's groups that those three share),
:mod:`.failures` (what torch's messages mean), :mod:`.rendezvous` (the group's private store).
Everything here runs in a rank (any torch process); the batch jobs' orchestrator is
:mod:`clorch_repl.jobs`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import (CollectiveError, CollectiveMismatch, CollectiveTimeout, JobStillRunning, JobStopped, JobTimeout,
                      NoProcessGroup)
from .collectives import (OP_NAMES, Work, all_gather_into, all_reduce, all_to_all_single, barrier, broadcast,
                          check_mode, emulate, recv, reduce, reduce_scatter_into, send)
from ..jobs.batch import Job, JobStatus, RankStatus, get_job, jobs, launch
from .group import process_group, rank, world_size

__all__ = ["process_group", "all_reduce", "broadcast", "reduce", "all_gather_into", "reduce_scatter_into",
           "all_to_all_single", "send", "recv", "barrier", "rank", "world_size", "launch", "jobs", "get_job", "Job",
           "save_checkpoint", "load_checkpoint"]

_LAZY = {"save_checkpoint": "clorch_repl.training.checkpoint", "load_checkpoint": "clorch_repl.training.checkpoint"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = getattr(module, name)
    globals()[name] = value
    return value
