"""A rank's process groups made usable again in place: what hang recovery and a replaced rank
rest on. Runs inside the rank; the notebook decides when (:mod:`clorch_repl.session.recovery`).

Why in place: every object built on a group holds torch's ``ProcessGroup`` object itself (a DDP
model's reducer, FSDP2's DeviceMesh through the group's name, ``dist.group.WORLD`` kept in a
variable). A new group made with ``init_process_group`` would leave all of them on the dead one.
torchft keeps one process-group object whose inner backend it replaces; torch's ``ProcessGroup``
is already that object: it maps each device type to a backend (``_register_backend``). So the
group keeps its object, its name, its rank and its registry entry, and only its backend is
replaced: every holder uses the new one at its next collective, with no Python in the path.

One catch decides the design: ``ProcessGroup::setBackend`` keeps the first backend registered for
a ``BackendType`` and hands it out again for a second one of that type (measured: a new gloo
backend registered as GLOO left the group on its dead connections). So each re-form registers
its backends under a type this group has not used yet (:data:`_SLOTS`): the group's own type,
then six more, after which :class:`RegroupError` says so and ``%clorch restart`` is the way.

Two steps, in two threads of the rank:

* :func:`abort` (the control thread, while the main thread may be stuck in a collective): NCCL
  communicators are aborted (``ncclCommAbort`` makes the waiting kernel return); gloo has no
  abort that frees a waiting call while anything holds the group, so the TCP connections its
  backends made are shut down (``shutdown(SHUT_RDWR)``), which makes the waiting call raise at
  once. Which sockets are gloo's is recorded when a group is created (:func:`track_group_sockets`:
  the sockets that appeared during torch's ``_new_process_group_helper``), never the rendezvous
  store's (its port is left alone) nor a listening socket (gloo's listener thread ends the
  process when its socket fails).
* :func:`reform` (the main thread, as a request once every rank is out of its cell): new backends
  for the groups, met through the session's rendezvous store under a prefix of their own
  (``clorch-regroup/GEN``), registered into the same ``ProcessGroup`` objects. A fresh rank
  replacing a dead one joins the same meeting point with ``init_process_group``
  (:func:`joining_store`), so the chain of store prefixes below is exactly the one torch's own
  ``init_process_group`` builds on a store it is given (the group's name, then the device).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

logger = logging.getLogger(__name__)

#: Where a re-formed group's backends meet in the session's store (GEN: the session's count).
PREFIX = "clorch-regroup"
#: The survivors' count of groups made, for a fresh rank to take (see :func:`adopt_group_count`).
GROUP_COUNT_KEY = "clorch-group-count"


class RegroupError(RuntimeError):
    """A group could not be formed again in this process."""


@dataclass
class _State:
    """This process's record of its groups' sockets and re-forms (one per process)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: inodes of the TCP sockets that appeared while a group's backends were created
    sockets: set[int] = field(default_factory=set)
    #: id(ProcessGroup) -> the backend types its backends were registered under so far
    slots: dict[int, list[Any]] = field(default_factory=dict)
    #: whether torch's group helper is wrapped to record them (track_group_sockets)
    tracked: bool = False
    #: the session's rendezvous store as the rank joined with it (every re-form meets under it)
    root: Any = None


_STATE = _State()


def adopt_group_count(store: Any) -> None:
    """In a fresh rank that joined survivors: number the groups it makes from now on as they do.
    torch names a ``dist.new_group`` by a count of the groups each process made; the fresh rank
    has made one, the survivors more, and groups named differently never meet."""
    import torch.distributed.distributed_c10d as c10d

    c10d._world.group_count = int(store.get(GROUP_COUNT_KEY).decode())


def store_prefix(generation: int) -> str:
    """The prefix under which the ranks of re-form ``generation`` meet in the session's store."""
    return f"{PREFIX}/{generation}"


def joining_store(store: Any, generation: int = 0) -> Any:
    """The store a rank joins the session's group with: ``store`` itself for the session's first
    group, else under :func:`store_prefix` (a fresh rank meeting the survivors of a re-form).
    Remembers ``store``, under which every later re-form of this rank meets."""
    import torch.distributed as dist

    _STATE.root = store
    return store if generation == 0 else dist.PrefixStore(store_prefix(generation), store)


# ------------------------------------------------------------------------------ socket record
def _socket_inodes() -> set[int]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def track_group_sockets() -> None:
    """Record the sockets every later process group's backends make (once per process; before
    the session's group is created). Wraps torch's ``_new_process_group_helper``, which
    ``init_process_group``, ``new_group`` and DeviceMesh all go through."""
    import torch.distributed.distributed_c10d as c10d

    with _STATE.lock:
        if _STATE.tracked:
            return
        original = c10d._new_process_group_helper

        def helper(*args: Any, **kwargs: Any) -> Any:
            with recording():
                return original(*args, **kwargs)

        helper.__wrapped__ = original  # type: ignore[attr-defined]
        c10d._new_process_group_helper = helper
        _STATE.tracked = True


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """The sockets that appear inside it are a group's (see :func:`abort`)."""
    before = _socket_inodes()
    try:
        yield
    finally:
        made = _socket_inodes() - before
        with _STATE.lock:
            _STATE.sockets |= made


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of this process's network namespace's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


_LISTEN = "0A"


def _shut_group_sockets() -> int:
    """Shut down the recorded group connections still open; how many were shut."""
    store_port = int(os.environ.get("MASTER_PORT", "0") or 0)
    table = _tcp_table()
    with _STATE.lock:
        wanted = set(_STATE.sockets)
    shut = 0
    for fd_name in os.listdir("/proc/self/fd"):
        fd = int(fd_name)
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        inode = int(target[8:-1])
        entry = table.get(inode)
        if inode not in wanted or entry is None:
            continue
        local, remote, state = entry
        if state == _LISTEN or store_port in (local, remote):
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        sock = socket.socket(fileno=dup)
        try:
            if os.fstat(dup).st_ino != inode:  # the descriptor was closed and reused meanwhile
                continue
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError as exc:  # closed by its owner meanwhile: nothing left to free
            logger.debug("shutting a group socket failed: %s", exc)
        finally:
            sock.close()
    return shut


# ------------------------------------------------------------------------------------ groups
def _groups() -> list[Any]:
    """The process groups this rank is a member of, in the order they were made (the default
    first): the same order on every rank, since groups are made collectively."""
    import torch.distributed.distributed_c10d as c10d

    return list(getattr(c10d._world, "pg_map", {}) or {})


def _device_name(device_type: Any) -> str:
    """``DeviceType.CPU`` (what ``ProcessGroup._device_types`` holds) -> ``cpu``."""
    return str(device_type).rsplit(".", 1)[-1].lower()


def _backends(pg: Any) -> list[Any]:
    import torch

    seen, found = set(), []
    for device_type in pg._device_types:
        try:
            backend = pg._get_backend(torch.device(_device_name(device_type)))
        except RuntimeError:
            continue
        if id(backend) not in seen:
            seen.add(id(backend))
            found.append(backend)
    return found


def abort() -> dict[str, Any]:
    """Free every call of this rank that waits in one of its groups (see the module docstring);
    runs on the control thread. Returns what it did, for the notebook's log."""
    t0 = time.monotonic()
    aborted = 0
    for pg in _groups():
        for backend in _backends(pg):
            if "nccl" in type(backend).__name__.lower():
                try:
                    backend.abort()
                    aborted += 1
                except RuntimeError as exc:
                    logger.warning("aborting an NCCL communicator failed: %s", exc)
    shut = _shut_group_sockets()
    return {"communicators": aborted, "sockets": shut, "seconds": round(time.monotonic() - t0, 3)}


def _slots(pg: Any) -> list[Any]:
    """Backend types not yet used by ``pg``, in the order re-forms take them."""
    from torch.distributed import ProcessGroup

    kinds = ProcessGroup.BackendType
    order = [kinds.CUSTOM, kinds.UCC, kinds.MPI, kinds.XCCL, kinds.UNDEFINED, kinds.GLOO, kinds.NCCL]
    used = _STATE.slots.setdefault(id(pg), [_own_type(pg)])
    return [kind for kind in order if kind not in used]


def _own_type(pg: Any) -> Any:
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import ProcessGroup

    name = str(c10d._world.pg_map[pg][0]).lower()
    return ProcessGroup.BackendType.NCCL if "nccl" in name else ProcessGroup.BackendType.GLOO


def _new_backend(pg: Any, group_store: Any, device_key: str, kind: str) -> Any:
    """A backend of ``kind`` for ``pg``'s members, met through ``group_store`` (the group's own
    store, ``NAME/`` on its base) under ``DEVICE/``, as torch's own helper meets."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    name = c10d._world.pg_names[pg]  # never pg.group_name: it reads the first backend's, "" on ours
    members = sorted(c10d._world.pg_group_ranks[pg], key=lambda g: c10d._world.pg_group_ranks[pg][g])
    meeting = dist.PrefixStore(f"{device_key}/", group_store)
    old = _backends(pg)[0]
    timeout = getattr(getattr(old, "options", None), "_timeout", None) or c10d.default_pg_timeout
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = members
        options.group_name = name
        backend = dist.ProcessGroupNCCL(meeting, pg.rank(), pg.size(), options)
    else:
        backend = dist.ProcessGroupGloo(meeting, pg.rank(), pg.size(), timeout=timeout)
        backend.options.global_ranks_in_group = members
        backend.options.group_name = name
    backend._set_sequence_number_for_group()
    return backend


def _forget(pg: Any) -> None:
    """End a group the fresh rank never made (it can never meet again), as torch's own destroy
    does: gone from torch's registry, so using it says so at once instead of waiting, and what
    caches it (the checkpoints' group) makes a new one with every rank."""
    import torch.distributed.distributed_c10d as c10d

    from .torchrun import torch_destroy

    try:
        torch_destroy()(pg)
    except (RuntimeError, ValueError) as exc:  # its backends are aborted: forget it all the same
        logger.warning("destroying the group %r left behind failed (%s); forgetting it",
                       c10d._world.pg_names.get(pg), exc)
        for registry in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks):
            registry.pop(pg, None)


def reform(generation: int, only_default: bool = False) -> list[tuple[list[int], str | None]]:
    """Give every group of this rank (only the default one with ``only_default``: a fresh rank
    joins, which has none of the others) new backends met under :func:`store_prefix`; returns
    each group it did not carry over, as (its global ranks, torch's description of it: how it
    was made, see :func:`.group.left_behind_notice`). Runs on the main thread, outside any cell."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ..diagnosis import record

    if not dist.is_initialized():
        raise RegroupError(f"rank {os.environ.get('RANK', '?')} has no process group to form again")
    default = c10d._get_default_group()
    # torch's own chain, on a store given to init_process_group (the root): the default group
    # meets under its name, every later group under its name on the default group's store, then
    # the device (_new_backend); a re-form's root is the session's store under its own prefix
    root = _STATE.root if _STATE.root is not None else c10d._world.pg_map[default][1].underlying_store
    store = dist.PrefixStore(store_prefix(generation), root)
    default_store = dist.PrefixStore(f"{c10d._world.pg_names[default]}/", store)
    if only_default:
        store.set(GROUP_COUNT_KEY, str(c10d._world.group_count))  # for the fresh rank (adopt_group_count)
    record.retire_current()  # the dead backends' records must not read as pending collectives
    left: list[tuple[list[int], str | None]] = []
    for pg in _groups():
        if only_default and pg is not default:
            left.append((sorted(c10d._world.pg_group_ranks.get(pg, {})), getattr(pg, "group_desc", None)))
            _forget(pg)
            continue
        slots = _slots(pg)
        if not slots:  # (the notebook's report names the rank and says what to do next)
            which = "the default group" if pg is default else f"the group {c10d._world.pg_names[pg]!r}"
            raise RegroupError(f"{which} was formed again as often as torch allows in one process")
        name, desc = c10d._world.pg_names[pg], pg.group_desc  # read before a backend of ours is first
        kind = "nccl" if _own_type(pg) == dist.ProcessGroup.BackendType.NCCL else "gloo"
        group_store = default_store if pg is default else dist.PrefixStore(f"{name}/", default_store)
        with recording():
            backend = _new_backend(pg, group_store, "cuda" if kind == "nccl" else "cpu", kind)
        c10d._world.pg_map[pg] = (c10d._world.pg_map[pg][0], group_store)  # where later new_group meets
        for device_type in pg._device_types:
            pg._register_backend(torch.device(_device_name(device_type)), slots[0], backend)
        _STATE.slots[id(pg)].append(slots[0])
        pg._set_group_name(name)  # names the new backend too (its flight-recorder entries)
        pg._set_group_desc(desc)
        if kind == "nccl" and pg.bound_device_id is not None:
            backend.eager_connect_single_device(pg.bound_device_id)
    return left

