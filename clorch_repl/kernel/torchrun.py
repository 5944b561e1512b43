"""Inside a rank: what torchrun code does to the process group, accepted or refused.

A torchrun script (run with ``%clorch run`` or pasted into a ``%%distributed`` cell) starts with
``init_process_group(...)`` and ends with ``destroy_process_group()``. In a session the group was
formed at ``%clorch start`` and must outlive the script: torch's own ``init_process_group`` raises
"trying to initialize the default process group twice!", and its ``destroy_process_group()``
leaves a rank whose every later collective fails while ``%clorch status`` reads idle. So a rank
replaces three of torch's functions (:func:`install`, when it joins its group):

* ``init_process_group`` agrees or refuses: a call that asks for what the session's group is
  (backend, world size, rank, ``env://``, any timeout, this rank's ``device_id``) returns at once
  and the session's group stays the default; one that asks for something else raises one
  :class:`~clorch_repl.errors.GroupConflict` naming every difference (:func:`disagreement`).
* ``destroy_process_group()`` of the default group ends the subgroups the code made and keeps the
  session's group, saying so once per process in one line; ``destroy_process_group(subgroup)``
  is torch's.
* ``torch.multiprocessing.spawn`` / ``start_processes`` raise
  :class:`~clorch_repl.errors.SpawnRefused` before any process starts: the rank already is one
  of the world's processes.

Errors raised here render without this package's frames (IPython's ``_render_traceback_``), so a
rank's traceback ends at the user's own call, as the kernel does for a refused ``input()``
(:mod:`.tracebacks`).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..common import env_vars
from ..errors import GroupConflict, SpawnRefused
from . import tracebacks
from .tracebacks import hide_own_frames

logger = logging.getLogger(__name__)
tracebacks.hide_frames_of(__file__)

#: what the one-line note of a kept group starts with (said once per process)
KEPT_NOTE = "clorch: destroy_process_group() kept the session's"
_state: dict[str, Any] = {"installed": False, "noted": False, "session_groups": (), "originals": {}}


@dataclass(frozen=True)
class GroupFacts:
    """The session's group as a rank sees it: what an ``init_process_group`` call must agree with."""

    backend: str
    world_size: int
    rank: int
    #: this rank's device as torch writes it: ``cpu`` or ``cuda:N`` (N: LOCAL_RANK where the rank
    #: sees its host's GPUs, as under torchrun; 0 where it sees its own GPU only)
    device: str


def disagreement(facts: GroupFacts, backend: Any = None, init_method: str | None = None, world_size: int = -1,
                 rank: int = -1, store: Any = None, pg_options: Any = None, device_id: Any = None) -> list[str]:
    """Every way an ``init_process_group`` call differs from the session's group (empty: it
    agrees). A timeout and a group name are always accepted: the group keeps the session's
    timeout (``%clorch start --timeout``). Each entry says what to do instead."""
    found: list[str] = []
    asked = "" if backend is None else str(backend).strip().lower()
    if asked not in ("", facts.backend, "undefined"):
        how = (f"%clorch start --backend {asked} starts a session with that backend" if asked in ("gloo", "nccl")
               else f"leave backend out, or pass {facts.backend!r}")
        found.append(f"backend={str(backend)!r}, but the session's group uses {facts.backend} ({how})")
    if init_method not in (None, "", "env://"):
        found.append(f"init_method={init_method!r} would form a second group; the session's group is already "
                     "formed: leave init_method out or pass 'env://'")
    if store is not None:
        found.append("store= gives a rendezvous store of its own; the session's group has one: leave store out")
    if world_size not in (None, -1) and int(world_size) != facts.world_size:
        found.append(f"world_size={world_size}, but the session's group has {facts.world_size} rank(s) "
                     f"(%clorch start --nproc {world_size} for {world_size}; or read it from os.environ['WORLD_SIZE'])")
    if rank not in (None, -1) and int(rank) != facts.rank:
        found.append(f"rank={rank}, but this process is rank {facts.rank} of the session's group "
                     "(read it from os.environ['RANK'])")
    if pg_options is not None:
        found.append("pg_options cannot change a group that is already formed: leave them out")
    if device_id is not None:
        given = _device_text(device_id)
        if facts.device == "cpu" and given != "cpu":
            found.append(f"device_id={given}, but this rank has no GPU (a {facts.backend} session on the CPU): "
                         "leave device_id out, or pass the rank's device (device_id=device, which is cpu here)")
        elif facts.device != "cpu" and given not in (facts.device, facts.device.split(":")[0]):
            found.append(f"device_id={given}, but this rank's GPU is {facts.device} in its process: pass "
                         "device_id=device (or torch.device('cuda', int(os.environ['LOCAL_RANK'])))")
    return found


def _device_text(device_id: Any) -> str:
    """``3`` -> ``cuda:3``; a torch.device or a string as torch writes it."""
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        return f"cuda:{device_id}"
    return str(device_id)


# ------------------------------------------------------------------------------ rank-side patches
def install() -> None:
    """Replace torch's ``init_process_group``, ``destroy_process_group``, ``mp.spawn`` and
    ``mp.start_processes`` in this rank (once), everywhere user code reaches them: the
    ``torch.distributed`` names, ``distributed_c10d``'s, and ``torch.multiprocessing``'s. Called
    after the session's group formed, which it remembers as the groups to keep."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.multiprocessing as mp

    _state["session_groups"] = tuple(_groups())
    if _state["installed"]:
        return
    spawn_module = sys.modules.get("torch.multiprocessing.spawn")
    originals = _state["originals"]
    originals["init"] = c10d.init_process_group
    originals["destroy"] = c10d.destroy_process_group
    originals["spawn"], originals["start_processes"] = mp.spawn, mp.start_processes
    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.destroy_process_group = destroy_process_group
    for module in (mp, spawn_module):
        if module is not None:
            module.spawn = _refuse("torch.multiprocessing.spawn")
            module.start_processes = _refuse("torch.multiprocessing.start_processes")
    _state["installed"] = True


def uninstall() -> None:
    """torch's own ``init_process_group``, ``destroy_process_group``, ``spawn`` and
    ``start_processes`` back: a script job's rank (``launch(script=...)``) once its script ended,
    whose group is then destroyed by torch's own function."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.multiprocessing as mp

    if not _state["installed"]:
        return
    originals = _state["originals"]
    for module in (dist, c10d):
        module.init_process_group = originals["init"]
        module.destroy_process_group = originals["destroy"]
    for module in (mp, sys.modules.get("torch.multiprocessing.spawn")):
        if module is not None and "spawn" in originals:
            module.spawn, module.start_processes = originals["spawn"], originals["start_processes"]
    _state["installed"] = False


def torch_destroy() -> Callable[..., None]:
    """torch's own ``destroy_process_group`` (the session's clean stop ends its group with it)."""
    import torch.distributed.distributed_c10d as c10d

    return _state["originals"].get("destroy") or c10d.destroy_process_group


def _groups() -> list[Any]:
    """Every process group this process holds (the default one included)."""
    import torch.distributed.distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def session_facts() -> GroupFacts:
    """The session's default group, from torch and the rank's environment."""
    import torch.distributed as dist

    from ..wire.rank_env import device_index

    index = device_index(os.environ)  # group.join_group's choice: cuda:{LOCAL_RANK} under torchrun's convention
    device = "cpu" if index is None else f"cuda:{index}"
    return GroupFacts(backend=str(dist.get_backend()).lower(), world_size=dist.get_world_size(),
                      rank=dist.get_rank(), device=device)


def init_process_group(backend: Any = None, init_method: str | None = None, timeout: Any = None,
                       world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None, **more: Any) -> None:
    """torch's ``init_process_group`` inside a session's rank (see the module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized():  # no session group (it failed, or torch's own destroy was called)
        return _state["originals"]["init"](backend=backend, init_method=init_method, timeout=timeout,
                                           world_size=world_size, rank=rank, store=store, group_name=group_name,
                                           pg_options=pg_options, device_id=device_id, **more)
    facts = session_facts()
    found = disagreement(facts, backend, init_method, world_size, rank, store, pg_options, device_id)
    found += [f"{key}= is not something the session's group can take: leave it out" for key, value in more.items()
              if value is not None]
    if found:
        raise hide_own_frames(GroupConflict(
            f"init_process_group() disagrees with the session's {facts.backend} group of "
            f"{facts.world_size} rank(s), formed at %clorch start: " + "; ".join(found)))
    logger.debug("init_process_group(%r, ...) agrees with the session's group: kept", backend)
    return None


def destroy_process_group(group: Any = None) -> None:
    """torch's ``destroy_process_group`` inside a session's rank (see the module docstring)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    destroy = _state["originals"]["destroy"]
    if not dist.is_initialized():
        return destroy(group)
    default = c10d._get_default_group()
    if group is not None and group is not default:
        return destroy(group)  # a subgroup: torch's own
    keep = set(_state["session_groups"]) | {default}
    made = [pg for pg in _groups() if pg not in keep]
    for pg in made:
        destroy(pg)
    if made and "clorch_repl.distributed._c10d" in sys.modules:
        sys.modules["clorch_repl.distributed._c10d"].forget_groups()
    if not _state["noted"]:
        _state["noted"] = True
        ended = f"; ended {len(made)} subgroup(s) the code made" if made else ""
        if os.environ.get(env_vars.JOB_ID.name):  # a launch() job's rank: no cells follow, no restart
            print(f"clorch: destroy_process_group() kept the job's {dist.get_backend()} group{ended}: it ends "
                  "with the job", file=sys.stdout, flush=True)
        else:
            print(f"{KEPT_NOTE} {dist.get_backend()} group{ended}: later cells still run in it "
                  "(%clorch restart for a fresh one)", file=sys.stdout, flush=True)  # a notice: not on red
    return None


def _refuse(name: str) -> Callable[..., Any]:
    def refused(fn: Any = None, args: Any = (), nprocs: int = 1, *more: Any, **options: Any) -> Any:
        world = os.environ.get("WORLD_SIZE", "?")
        what = getattr(fn, "__name__", "the function")
        raise hide_own_frames(SpawnRefused(
            f"{name}({what}, nprocs={nprocs}) would start processes of its "
            f"own, but this rank already is one of the session's {world} ranks: call {what}(rank, *args) on "
            "every rank instead (%clorch run and %%distributed run code once per rank, as torchrun does), "
            "or run the script outside the notebook; no process was started"))

    refused.__name__ = name.rsplit(".", 1)[1]
    refused.__qualname__ = refused.__name__
    return refused
