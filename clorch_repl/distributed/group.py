"""The process group's lifecycle: join from the environment the launcher and ``%clorch`` set,
always leave, and never hang on the way out after an error.

Decision: when a default group already exists (inside a ``%clorch`` worker kernel, or a rank whose
code initialised torch.distributed itself), :func:`process_group` yields that group and leaves it
alone on exit. Whoever created a group owns its teardown; destroying the kernel's group from a
``with`` block in a cell would break every later cell.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
from typing import Any, Iterator

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

from .. import cuda
from ..common import env_vars
from ..errors import ConfigError
from .rendezvous import loopback_store
from ..common.procs import LOOPBACK, free_port
from ..common.topology import BACKENDS, parse_timeout
from . import _c10d, collectives

logger = logging.getLogger(__name__)

ENV_BACKEND = env_vars.DIST_BACKEND.name
ENV_TIMEOUT_MS = env_vars.DIST_TIMEOUT_MS.name


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be a whole number; got {value!r}") from None


def rank() -> int:
    """This process's global rank; outside a group, the rank the launcher assigned (RANK) or 0,
    so code can branch on it before joining."""
    if _c10d.active():
        return _c10d.rank()
    return _env_int("RANK", 0) or 0


def world_size() -> int:
    """Number of ranks in the default group; outside a group, WORLD_SIZE or 1."""
    if _c10d.active():
        return _c10d.world_size()
    return _env_int("WORLD_SIZE", 1) or 1


def _resolve_backend(backend: str | None) -> str:
    chosen = backend or os.environ.get(ENV_BACKEND) or None
    if chosen is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        has_gpu = visible != "" and cuda.available()  # never initialises CUDA here
        chosen = "nccl" if has_gpu else "gloo"
    chosen = str(chosen).lower()
    if chosen not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {chosen!r}")
    return chosen


def _resolve_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    seconds = parse_timeout(timeout, "timeout")  # seconds; a timedelta was handled above
    if seconds is not None:
        return datetime.timedelta(seconds=seconds)
    ms = _env_int(ENV_TIMEOUT_MS, None)
    if ms is None:
        return None  # torch's own default
    if ms <= 0:
        raise ConfigError(f"{ENV_TIMEOUT_MS} must be a positive number of milliseconds; got {ms}")
    return datetime.timedelta(milliseconds=ms)


def _cuda_device(backend: str) -> torch.device | None:
    """The one GPU this rank drives: index LOCAL_RANK of a host-wide CUDA_VISIBLE_DEVICES
    (torchrun's convention, which a session's ranks and a script job's follow), or the one GPU a
    launcher gave the rank alone (index 0: a ``main=`` job's ranks, the seed's table)."""
    if backend != "nccl":
        return None
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(f"the nccl backend needs a GPU, but rank {os.environ.get('RANK', '?')} on "
                          f"{socket.gethostname()} sees none (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): for CPU ranks use the gloo backend "
                          "(--backend gloo)")
    local = _env_int("LOCAL_RANK", 0) or 0
    index = 0 if count == 1 else local
    if index >= count:
        raise ConfigError(f"LOCAL_RANK {local} has no GPU: only {count} are visible to this rank")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _init(backend: str | None, timeout: float | datetime.timedelta | None) -> Any:
    chosen = _resolve_backend(backend)
    td = _resolve_timeout(timeout)
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is None and env_world is None:
        # Not launched: a one-rank world, so the same code runs in a plain script or notebook.
        rank_, world = 0, 1
        addr, port = LOOPBACK, free_port()
    else:
        if env_rank is None or env_world is None:
            raise ConfigError("RANK and WORLD_SIZE must be set together (dist.launch and %clorch set "
                              "both); set both, or neither for a one-rank group")
        rank_, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        addr = os.environ.get("MASTER_ADDR", LOOPBACK)
        port_s = os.environ.get("MASTER_PORT")
        if not port_s:
            raise ConfigError(f"MASTER_PORT is not set for rank {rank_}: every rank needs the same "
                              "rendezvous port (dist.launch chooses one)")
        port = int(port_s)
        if not 0 <= rank_ < world:
            raise ConfigError(f"RANK {rank_} is outside WORLD_SIZE {world}")
    store_timeout = td if td is not None else datetime.timedelta(minutes=10)
    kwargs: dict[str, Any] = {"backend": chosen, "rank": rank_, "world_size": world,
                              "store": loopback_store(rank_, world, store_timeout, addr, port)}
    if td is not None:
        kwargs["timeout"] = td
    device = _cuda_device(chosen)
    if device is not None:
        kwargs["device_id"] = device
    try:
        tdist.init_process_group(**kwargs)
    except TypeError:  # torch without device_id (before 2.3)
        kwargs.pop("device_id", None)
        tdist.init_process_group(**kwargs)
    return c10d.GroupMember.WORLD


def abort() -> None:
    """Tear the default group down without waiting for peers: after an error a peer may never
    arrive, and a graceful destroy (NCCL especially) would then hang the rank at exit."""
    if not tdist.is_initialized():
        return
    aborter = getattr(c10d, "_abort_process_group", None)
    try:
        if aborter is not None:
            aborter()
        else:
            pg = c10d.GroupMember.WORLD
            if pg is not None and hasattr(pg, "abort"):
                pg.abort()
    except Exception as exc:  # noqa: BLE001 - tearing down after an error: go on to destroy
        logger.warning("rank %s: aborting the process group failed (%s: %s); destroying it instead",
                       os.environ.get("RANK", "?"), type(exc).__name__, exc)
    if tdist.is_initialized():
        try:
            tdist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the error that brought us here is the one to report
            logger.warning("rank %s: destroying the process group after an error failed (%s: %s); the "
                           "rank's exit frees it", os.environ.get("RANK", "?"), type(exc).__name__, exc)


@contextlib.contextmanager
def process_group(backend: str | None = None, timeout: float | datetime.timedelta | None = None, *,
                  check: bool | None = None) -> Iterator[Any]:
    """Join the default process group for the duration of the block, and yield it.

    Settings come from the arguments, else the environment (``CLORCH_DIST_BACKEND``,
    ``CLORCH_DIST_TIMEOUT_MS``, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK); with no RANK and
    WORLD_SIZE at all the group is a one-rank world. On NCCL the rank's GPU becomes the current
    device. A normal exit destroys the group; an exception aborts it so no rank waits at exit for
    peers that will never come. ``timeout`` is seconds (or a timedelta). ``check=True`` (or env
    ``CLORCH_DIST_CHECK=1``) turns on the cross-rank check of every collective for the block.

    If a default group already exists it is yielded as is and not torn down (see module doc).
    """
    previous_check = collectives.check_mode()
    if check is not None:
        collectives.check_mode(bool(check))
    owned = not tdist.is_initialized()
    try:
        if owned:
            pg = _init(backend, timeout)
        else:
            pg = c10d.GroupMember.WORLD
        try:
            yield pg
        except BaseException:
            if owned:
                abort()
            raise
        else:
            if owned and tdist.is_initialized():
                tdist.destroy_process_group()
    finally:
        _c10d.forget_groups()
        collectives.check_mode(previous_check)
