"""The environment of one rank, written in one place for every launcher.

A rank's process learns who it is and how to join its group from its environment, in the words of
torchrun and API.md (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) plus clorch's own (``CLORCH_DIST_BACKEND``,
``CLORCH_DIST_TIMEOUT_MS``, the private rendezvous file, the CPU binding). The session's local
ranks, the nanny of a remote rank (:mod:`clorch_repl.host.nanny`) and ``dist.launch`` batch ranks all
build it with :func:`rank_environment`, so a variable added for one reaches all of them; and a
process started by srun or torchrun learns its place with :func:`read_identity`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..common import env_vars
from ..common.procs import LOOPBACK
from ..errors import ConfigError
from ..placement.slurm_tasks import task_place

if TYPE_CHECKING:
    from ..common.topology import Topology

logger = logging.getLogger(__name__)

BACKEND_ENV = env_vars.DIST_BACKEND.name
TIMEOUT_ENV = env_vars.DIST_TIMEOUT_MS.name
#: Path of the group's FileStore, in a private directory (one host only; see clorch_repl.distributed.rendezvous)
STORE_FILE_ENV = env_vars.STORE_FILE.name
#: ``numa`` or ``none``: whether the rank binds itself to its GPU's NUMA node (clorch_repl.kernel.numa)
CPU_BIND_ENV = env_vars.CPU_BIND.name
#: the rank's own GPU as its host names it (a physical index or a UUID): what NUMA binding and the
#: GPU figures of ``%clorch top`` read, whatever position CUDA_VISIBLE_DEVICES gives it
GPU_INDEX_ENV = env_vars.GPU_INDEX.name
#: set in a warm spare's environment (clorch_repl.launchers.local): it imports torch before its
#: kernel starts, and it learns the group's meeting point only when it is made a rank
SPARE_ENV = env_vars.SPARE.name
#: a spare's rank log: where it moves its stdout and stderr when it is made a rank
RANK_LOG_ENV = env_vars.RANK_LOG.name
#: variables of an elastic agent (torchrun) that must not steer the rank's own process group:
#: its store is torchrun's rendezvous, not the group's (API.md: never reuse torchrun's port)
_AGENT_ONLY = ("TORCHELASTIC_USE_AGENT_STORE",)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in its world and how the world meets."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    timeout_s: float
    #: the rank's GPU as CUDA_VISIBLE_DEVICES names it on its host (an index or a UUID), None
    #: for a CPU rank
    gpu: str | None = None
    #: the GPUs of the world's ranks on this rank's host, by local rank (``host_gpus[local_rank]``
    #: is ``gpu``): all of them are made visible, so ``cuda:{LOCAL_RANK}`` is the rank's own GPU as
    #: under torchrun (see :func:`visible_devices`); empty: the rank sees its own GPU only
    host_gpus: tuple[str, ...] = ()
    #: a FileStore path (ranks on one host), or None: a TCPStore at master_addr:master_port
    store_file: str | None = None
    #: the network interface gloo/NCCL use (ranks on several hosts), unless the user set one
    socket_ifname: str | None = None
    cpu_bind: str = "none"


#: The interface gloo and NCCL use where the ranks of one host meet over loopback.
LOOPBACK_IFNAME = "lo"


def local_place(topology: Topology, rank: int, *, master_port: int, store_file: str, timeout_s: float | None = None,
                host_gpus: bool = True) -> RankPlace:
    """Rank ``rank`` of a group whose ranks all run on this host (a session's local ranks, a
    local batch job's): its local rank is its rank, the group meets over loopback through the
    FileStore ``store_file``, and its GPU is the topology's (:meth:`Topology.visible_devices`).
    ``timeout_s``: the group's timeout where it is not the topology's; ``host_gpus=False``: the
    rank sees its own GPU only, not every rank's at ``cuda:{LOCAL_RANK}``."""
    return RankPlace(rank=rank, local_rank=rank, world_size=topology.nproc, local_world_size=topology.nproc,
                     master_addr=LOOPBACK, master_port=master_port, backend=topology.backend,
                     timeout_s=topology.timeout_s if timeout_s is None else timeout_s,
                     gpu=topology.visible_devices(rank) or None,
                     host_gpus=topology.host_gpus() if host_gpus else (), store_file=store_file,
                     socket_ifname=LOOPBACK_IFNAME, cpu_bind=topology.cpu_bind)


def world_environment(backend: str, timeout_s: float, store_file: str | None = None,
                      base: Mapping[str, str] | None = None, cpu_bind: str = "none") -> dict[str, str]:
    """What every rank of a world shares: ``base`` (default: this process's environment) with the
    backend, the process-group timeout, the rendezvous file (if any) and the CPU binding set,
    and the variables of an elastic agent that must not steer the group removed."""
    env = dict(os.environ if base is None else base)
    for key in _AGENT_ONLY:
        env.pop(key, None)
    env.update({BACKEND_ENV: backend, TIMEOUT_ENV: str(int(timeout_s * 1000)), CPU_BIND_ENV: cpu_bind,
                "PYTHONUNBUFFERED": "1"})
    if store_file:
        env[STORE_FILE_ENV] = store_file
    else:
        env.pop(STORE_FILE_ENV, None)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def rank_environment(place: RankPlace, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with one rank's variables set."""
    env = world_environment(place.backend, place.timeout_s, place.store_file, base, place.cpu_bind)
    env.update({
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        # "" keeps a CPU rank off every GPU
        "CUDA_VISIBLE_DEVICES": visible_devices(place.gpu, place.local_rank, place.host_gpus),
    })
    if place.gpu is not None:
        env[GPU_INDEX_ENV] = place.gpu
    else:
        env.pop(GPU_INDEX_ENV, None)
    if place.local_world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: ranks must not oversubscribe cores
    ifname = place.socket_ifname
    if ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    return env


def visible_devices(gpu: str | None, local_rank: int, host_gpus: tuple[str, ...] | list[str] = ()) -> str:
    """CUDA_VISIBLE_DEVICES for one rank: torchrun's convention where it can hold.

    Under torchrun every worker of a node sees the node's GPUs and picks its own as
    ``cuda:{LOCAL_RANK}`` (``torch.cuda.set_device(LOCAL_RANK)``, ``model.to(local_rank)``: the DDP
    tutorial, torchtitan, Hugging Face and Lightning all do). So a rank sees the GPUs of its host's
    ranks, listed in local-rank order (``--devices 2,3``: ``"2,3"``; GPU 3 is then ``cuda:1`` of
    local rank 1): index LOCAL_RANK is its own GPU, and no GPU of another session is visible.
    Where that cannot hold (no host list, or its entry for this local rank is another GPU: a
    launcher that gave each task one GPU of its own, ``srun --gpus-per-task=1``) the rank sees
    its own GPU only, as ``cuda:0``. "" for a CPU rank."""
    if gpu is None:
        return ""
    listed = [str(g) for g in host_gpus]
    if len(set(listed)) != len(listed):
        raise ConfigError(f"local rank {local_rank}: its host's GPUs {','.join(listed)} name one GPU twice: "
                          "each rank of a host needs a GPU of its own (check --devices or CUDA_VISIBLE_DEVICES)")
    if 0 <= local_rank < len(listed) and listed[local_rank] == gpu:
        return ",".join(listed)
    if listed:
        logger.info("local rank %d: GPU %s is not entry %d of its host's GPUs %s: it sees its own GPU only",
                    local_rank, gpu, local_rank, ",".join(listed))
    return gpu


def host_gpu_lists(ranks: list[tuple[str, int, str | None, list[str]]]) -> list[tuple[str, ...]]:
    """For ranks on many hosts, each given as (host, local rank, its GPU or None, the GPUs its
    host lets it see): each rank's :attr:`RankPlace.host_gpus`, the GPUs of its host's ranks in
    local-rank order. A rank gets () (its own GPU only) where its host's list has a gap (a CPU
    rank, a local rank missing) or names a GPU it cannot see (one GPU per task)."""
    by_host: dict[str, dict[int, str | None]] = {}
    for host, local, gpu, _ in ranks:
        by_host.setdefault(host, {})[local] = gpu
    lists: list[tuple[str, ...]] = []
    for host, local, gpu, seen in ranks:
        locals_ = by_host[host]
        listed = [locals_.get(i) for i in range(max(locals_) + 1)]
        usable = gpu is not None and all(g is not None and g in seen for g in listed)
        lists.append(tuple(str(g) for g in listed) if usable else ())
    return lists


def device_index(env: Mapping[str, str]) -> int | None:
    """The index of this rank's own GPU in its process (``cuda:N``), from the environment
    :func:`rank_environment` wrote: its GPU's position in CUDA_VISIBLE_DEVICES (LOCAL_RANK where
    torchrun's convention holds, 0 where it sees one GPU). None for a CPU rank."""
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return None
    own = env.get(GPU_INDEX_ENV, "").strip()
    if own in visible:
        return visible.index(own)
    local = env.get("LOCAL_RANK", "")
    if len(visible) > 1 and local.isdigit() and int(local) < len(visible):
        return int(local)  # a host-wide list set by the user or a launcher: torchrun's convention
    return 0


@dataclass(frozen=True)
class Identity:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str


def read_identity(env: Mapping[str, str]) -> Identity:
    """Who this rank is, from torchrun's variables or else Slurm's."""
    try:
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            return Identity(int(env["RANK"]), int(env.get("LOCAL_RANK", "0")), world,
                            int(env.get("LOCAL_WORLD_SIZE", str(world))), "torchrun")
        task = task_place(env)  # Slurm's variables are read in one place, for every srun task
        if task is not None:
            return Identity(task.rank, task.local_rank, task.world_size, task.local_world_size, "slurm")
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"cannot read this rank's place from the launcher's variables ({exc})") from None
    raise ConfigError("no rank variables: run clorch-rank under torchrun (RANK, LOCAL_RANK, WORLD_SIZE) "
                      "or srun (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS)")


def identity_environment(identity: Identity) -> dict[str, str]:
    """torchrun's names for a rank's place, for a process that learnt it from Slurm's."""
    return {"RANK": str(identity.rank), "LOCAL_RANK": str(identity.local_rank),
            "WORLD_SIZE": str(identity.world_size), "LOCAL_WORLD_SIZE": str(identity.local_world_size)}


#: torchrun's variables beyond a rank's place, which torchrun scripts read (``%clorch run``)
TORCHRUN_RUN_ID = "clorch"


def torchrun_extras(env: Mapping[str, str]) -> dict[str, str]:
    """The rest of what torchrun's agent sets in a worker (``GROUP_RANK``, ``ROLE_*``,
    ``GROUP_WORLD_SIZE``, ``TORCHELASTIC_*``), derived from a rank's ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_WORLD_SIZE``, so that a torchrun script (or a cell pasted from one) that reads them
    finds them in a session's rank. Nodes hold the same number of ranks (``--nproc-per-node``),
    so the node's index is ``RANK // LOCAL_WORLD_SIZE`` (left out where LOCAL_WORLD_SIZE does
    not divide WORLD_SIZE: nodes of different sizes). Values already set (a rank started by a
    real torchrun, under ``--launcher attach``) are kept: they are torchrun's own.
    ``TORCHELASTIC_USE_AGENT_STORE`` is left out on purpose (see ``_AGENT_ONLY``)."""
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE") or world)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"cannot derive torchrun's variables from this rank's environment ({exc}): "
                          "RANK, WORLD_SIZE and LOCAL_WORLD_SIZE must be whole numbers") from None
    wanted = {"ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": TORCHRUN_RUN_ID}
    if local_world >= 1 and world % local_world == 0:  # else the nodes differ: no node index to derive
        wanted.update(GROUP_RANK=str(rank // local_world), GROUP_WORLD_SIZE=str(world // local_world))
    return {key: value for key, value in wanted.items() if key not in env}
