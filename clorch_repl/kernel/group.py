"""A rank joins and leaves the session's process group: :func:`join_group` runs inside every
rank's kernel when the session starts (and when a spare is made a rank) and gives the user's
namespace ``rank``, ``local_rank``, ``world_size`` and ``device``; :func:`leave_group` ends the
group before an ordinary exit, where the rank cannot take the quick one (:mod:`.quick_exit`).

A join is a request of the rank's registry (``join``: :mod:`.requests`) and runs
through the kernel (an execute request), not before it, so a failure to form the group
(a wrong device, an NCCL error, a rendezvous timeout) reaches the notebook as that rank's
traceback, and a stuck rendezvous can be interrupted like any cell.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

from ..common import env_vars
from .shell import current_shell

logger = logging.getLogger(__name__)


def join_group(env: dict[str, str] | None = None, generation: int = 0, *, protocol: int | None = None) -> None:
    """Initialise the default process group from the launcher's environment (see API.md).

    ``protocol``: the notebook's version of the wire contract (:mod:`clorch_repl.wire`), checked
    before anything else: a rank of another install refuses to join, naming both versions (None:
    a notebook from before the version was sent, refused as such).
    ``env``: variables a warm spare learns only now (the group's rendezvous file and port); they
    are set first. A spare (local or a remote rank's) then moves its output to its rank's log.
    ``generation``: the session's re-form count when this rank replaces a dead one: it meets the
    survivors where their re-formed group meets (:mod:`.regroup`)."""
    _check_protocol(protocol)
    if env:
        os.environ.update(env)
    _move_output_to_rank_log()
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    backend = os.environ[env_vars.DIST_BACKEND.name]
    timeout = datetime.timedelta(milliseconds=int(os.environ[env_vars.DIST_TIMEOUT_MS.name]))
    from ..wire.rank_env import device_index

    index = device_index(os.environ)  # LOCAL_RANK: the rank sees its host's GPUs, as under torchrun
    if index is not None:
        # the current device, as torchrun scripts set it: plain "cuda" is the rank's own GPU too
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        from ..diagnosis import record
        from ..distributed.rendezvous import loopback_store
        from . import regroup

        record.enable()  # read only when a group is created: now, before init_process_group
        regroup.track_group_sockets()  # what an abort must shut (hang recovery)
        store = regroup.joining_store(loopback_store(rank, world_size, timeout), generation)
        kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size,
                                  "timeout": timeout, "store": store}
        if backend == "nccl":
            # With device_id the NCCL communicator is created eagerly, here, instead of on the
            # first collective of the first cell.
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        if generation:
            regroup.adopt_group_count(store)
        if backend != "nccl":
            dist.barrier()  # the first cell should not pay for gloo's lazy connection set-up
    _accept_torchrun_code()
    shell = current_shell()
    # without a kernel (a benchmark joining from a plain script) the names go to this module
    ns = shell.user_ns if shell is not None else globals()
    ns.update(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        _answer_probes(kernel)
        _quiet_kernel_logger(kernel)


def _check_protocol(theirs: int | None) -> None:
    """Refuse to join a notebook of another wire contract: a rank started from another install (the
    package upgraded under a running notebook, a host's own environment) would otherwise fail
    later, and obscurely, on a message one side reads differently."""
    from .. import __version__
    from ..errors import ProtocolMismatch
    from ..wire import mismatch

    why = mismatch(theirs, "the notebook", what_to_do=(
        f"this rank runs clorch_repl {__version__} from {os.path.dirname(os.path.dirname(__file__))}; restart the "
        "notebook's kernel so that it imports the clorch_repl installed now, or install the notebook's version "
        "where the ranks run, then %clorch restart"))
    if why:
        raise ProtocolMismatch(f"rank {os.environ.get('RANK', '?')} cannot join: {why}")


def _accept_torchrun_code() -> None:
    """What a torchrun script finds in torchrun's workers: the rest of torchrun's variables, and
    its own init_process_group()/destroy_process_group() agreeing with the session's group
    (:mod:`.torchrun`), in %clorch run scripts and cells alike."""
    from ..errors import ConfigError
    from ..wire.rank_env import torchrun_extras
    from . import torchrun

    try:
        os.environ.update(torchrun_extras(os.environ))
    except ConfigError as exc:  # a convenience for scripts: the rank works without it
        logger.warning("rank %s: torchrun's extra variables not set: %s", os.environ.get("RANK", "?"), exc)
    torchrun.install()


def _move_output_to_rank_log() -> None:
    """A spare wrote its start-up to a log of its own; from now on its stdout and stderr (native
    output, faulthandler's crash reports and the echo of the kernel's streams alike: all of them
    write to descriptors 1 and 2) go to the log of the rank it has become, whose banner the
    launcher wrote just before this. Nothing to do in a rank started as a rank."""
    from ..wire.rank_env import RANK_LOG_ENV

    path = os.environ.pop(RANK_LOG_ENV, "")
    if not path:
        return
    import sys

    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError) as exc:  # the new log takes over below anyway
            logger.debug("flushing a spare's start-up output failed: %s", exc)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _answer_probes(kernel: Any) -> None:
    """Let the notebook ask this rank where it is while a cell blocks it (``%clorch why``)."""
    from .probes import install

    install(kernel)


def _quiet_kernel_logger(kernel: Any) -> None:
    """The kernel's logger is left at DEBUG with a WARNING handler, so every debug call (four per
    cell) builds a record that is then dropped: about 0.2 ms of a rank's CPU per cell. Raise the
    logger to its handlers' level; nothing that was shown before stops being shown."""
    log = getattr(kernel, "log", None)
    handlers = getattr(log, "handlers", None)
    if log is not None and handlers:
        log.setLevel(max(log.level, min(h.level for h in handlers)))


def leave_group() -> None:
    """Destroy the process group before an ordinary exit (NCCL warns at exit when it was not): only
    where the rank cannot end through :func:`.quick_exit.exit_now`, which runs no destructor."""
    import torch.distributed as dist

    from .torchrun import torch_destroy

    if dist.is_initialized():
        torch_destroy()()  # torch's own: the one user code reaches keeps the session's group


def rejoin(generation: int, fresh: list[int] | None = None, env: dict[str, str] | None = None, *,
           protocol: int | None = None) -> None:
    """The ``regroup`` request (:mod:`.requests`), sent to every live rank at once: a rank in
    ``fresh`` (a new process in a dead rank's place) joins the group with ``env`` as a start would
    (:func:`join_group`, which checks ``protocol``); every other rank gives its groups new backends
    (:func:`.regroup.reform`; only the default group when some rank is fresh, which has none of the others)
    and says on its output which of the user's groups were not carried over and how to make them
    again (:func:`left_behind_notice`; clorch's own are made again by themselves)."""
    if int(os.environ["RANK"]) in (fresh or ()):
        join_group(env, generation, protocol=protocol)
        return
    import torch.distributed as dist

    from .regroup import reform

    left = reform(generation, only_default=bool(fresh))
    if fresh and os.environ[env_vars.DIST_BACKEND.name] != "nccl":
        dist.barrier()  # the one a fresh gloo rank ends its join with (see join_group)
    notice = left_behind_notice(left)
    if notice:
        print(notice, flush=True)


# ------------------------------------------------------------------ groups not carried over
#: How torch's description of a group (``group_desc``) starts for every group clorch makes for its
#: own use (the sharded checkpoints': ``clorch_repl.training.checkpoint.ranks.GROUP_DESC``). clorch
#: makes such a group again by itself once it finds it gone, so a re-form never asks the user to.
OWN_DESC_PREFIX = "clorch:"


def clorch_made(desc: str | None) -> bool:
    """Whether a group of this description is one clorch made for itself (see :data:`OWN_DESC_PREFIX`)."""
    return bool(desc) and str(desc).startswith(OWN_DESC_PREFIX)


def maker(desc: str | None) -> str:
    """How the user made a group, read from torch's description of it: a DeviceMesh names each of its
    groups ``mesh_DIM`` (``mesh_dim_0`` for an unnamed dimension), ``dist.new_group`` leaves
    ``undefined`` unless given a ``group_desc``."""
    desc = str(desc or "undefined")
    if desc.startswith("mesh_"):
        dim = desc[len("mesh_"):]
        if dim == "default":
            return "init_device_mesh"
        if dim.startswith("dim_") and dim[len("dim_"):].isdigit():
            return f"init_device_mesh (its dimension {dim[len('dim_'):]})"
        return f"init_device_mesh (its dimension {dim!r})"
    return "dist.new_group" if desc == "undefined" else f"dist.new_group (group_desc={desc!r})"


def left_behind_notice(groups: list[tuple[list[int], str | None]]) -> str:
    """The line a survivor prints after a re-form that a fresh rank joined: the groups of
    ``groups`` (each one's global ranks and torch's description, every group but the default one)
    that the user made and must make again, by their ranks and how they were made (torch's names
    for them are bare counts); clorch's own are left out. "" when no group is the user's."""
    counts: dict[str, int] = {}
    for ranks, desc in groups:
        if not clorch_made(desc):
            what = f"of ranks {list(ranks)} made by {maker(desc)}"
            counts[what] = counts.get(what, 0) + 1
    if not counts:
        return ""
    named = "; ".join(("the group " if n == 1 else f"{n} groups ") + what for what, n in counts.items())
    them = "it" if sum(counts.values()) == 1 else "them"
    return (f"clorch: not carried over to the re-formed group: {named}. Make {them} again on every rank "
            f"(dist.new_group, init_device_mesh) before using {them}.")
