"""clorch_repl.distributed: process groups, collectives on every backend, and batch jobs.

Collectives work in place and accept the ops ``sum avg min max band bor bxor prod`` on NCCL and
gloo alike (see :mod:`.collectives` for the routes taken where a backend lacks an op, and their
cost). ``launch`` starts a batch job; :mod:`.launch` also keeps the registry behind
``%clorch jobs``. ``save_checkpoint``/``load_checkpoint`` come from :mod:`.checkpoint`, imported on
first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, JobStopped, JobTimeout, NoProcessGroup
from .collectives import (OP_NAMES, Work, all_gather_into, all_reduce, all_to_all_single, barrier, broadcast,
                          check_mode, emulate, recv, reduce, reduce_scatter_into, send)
from .group import process_group, rank, world_size
from .launch import Job, JobStatus, RankStatus, get_job, jobs, launch

# The submodule ``launch`` is shadowed here by the function of the same name, so the registry is
# also reachable as ``dist.launch.jobs()`` / ``dist.launch.get_job(id)``, the spelling of the docs.
launch.jobs = jobs  # type: ignore[attr-defined]
launch.get_job = get_job  # type: ignore[attr-defined]

__all__ = ["process_group", "all_reduce", "broadcast", "reduce", "all_gather_into", "reduce_scatter_into",
           "all_to_all_single", "send", "recv", "barrier", "rank", "world_size", "launch", "Job",
           "save_checkpoint", "load_checkpoint"]

_LAZY = {"save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint"}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{module_name}")
    value = getattr(module, name)
    globals()[name] = value
    return value
