"""How the ranks of a checkpoint save or load agree: every rank's verdict gathered, one error raised
on every rank naming the ranks that failed, and the process group that carries it.

Saving and loading are collectives: a failure on one rank must raise on every rank (naming it)
instead of leaving the others waiting at the next collective. Both formats use :func:`gather`
and :func:`raise_if_any`.

The group: the single-file format gathers over the default group, as it always did. The sharded
format runs torch.distributed.checkpoint's planning (``all_gather_object`` of plans) and, for an
asynchronous save, the whole write on a thread beside training: that needs a CPU backend (DCP's
async save refuses an NCCL-only group) and a group of its own, or the save's collectives would
interleave with training's on the default group in a different order on each rank.
:func:`checkpoint_group` makes that gloo group over every rank once per default group, on the first
sharded save or load (every rank calls those, so the ``new_group`` collective is met everywhere).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

from ...distributed import _c10d
from ...errors import CheckpointError, ClorchError, rank_words

logger = logging.getLogger(__name__)

__all__ = ["gather", "raise_if_any", "checkpoint_group"]

_GROUPS: dict[int, Any] = {}  # id(default group) -> its gloo group for checkpoints
#: torch's description of that group: "clorch:" marks a group clorch made for itself, which a rank's
#: re-form leaves out of what the user must make again (clorch_repl.kernel.group.clorch_made)
GROUP_DESC = "clorch:checkpoints"


def checkpoint_group() -> Any:
    """The gloo group of every rank that sharded checkpoints use; None without a process group.

    Made once per default group, and again if it was destroyed since: a collective then (every
    rank of a save or load gets here in the same order, and sees the same groups). A default group that is itself gloo-only still gets its own, for the
    asynchronous save's thread (see the module's docstring)."""
    if not _c10d.active():
        return None
    world = c10d.GroupMember.WORLD
    group = _GROUPS.get(id(world))
    registered = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if group is not None and registered is not None and group not in registered:
        group = None  # destroyed meanwhile (a torchrun script's destroy_process_group() ends subgroups)
    if group is None:
        _GROUPS.clear()  # groups of an earlier default group are gone with it
        group = tdist.new_group(backend="gloo", group_desc=GROUP_DESC)
        _GROUPS[id(world)] = group
        logger.debug("made a gloo group of %d ranks for checkpoints", tdist.get_world_size(group))
    return group


def gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (small Python objects only), in rank order; ``[obj]`` without a group."""
    if not _c10d.active():
        return [obj]
    size = tdist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    tdist.all_gather_object(out, obj, group=group)
    return out


def raise_if_any(errors: list[str | None], doing: str, *, changed: bool = False) -> None:
    """Raise one CheckpointError naming every rank whose entry in ``errors`` is set.

    ``changed``: whether the ranks may have changed something already (a load that failed while
    applying), which decides what the message tells the user to do next."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if len(errors) == 1:
        raise CheckpointError(failed[0][1])
    after = ("the ranks may now differ, so load it again (or restart the ranks)" if changed
             else "nothing was changed on any rank")
    if len({message for _, message in failed}) == 1:  # one cause seen by every failed rank
        raise CheckpointError(f"{doing} failed on {rank_words(r for r, _ in failed)}: {failed[0][1]}; {after}")
    lines = "; ".join(f"rank {r}: {e}" for r, e in failed)
    raise CheckpointError(f"{doing} failed on {rank_words(r for r, _ in failed)} ({lines}); {after}")


@contextlib.contextmanager
def agreed(doing: str, failed: str, group: Any = None) -> Iterator[None]:
    """Run the block on every rank, then agree on how it went: one gather of each rank's failure,
    and one :class:`CheckpointError` raised on every rank if any failed (:func:`raise_if_any`).

    A step that some rank may fail must be agreed on before any rank goes on to collectives
    (a state dict of FSDP1, DCP's planning): the ranks that went on would wait in them for the one
    that stopped, which waits in this agreement. ``failed``: what an unexpected exception is
    reported as (its type and text follow); a :class:`ClorchError` is reported as it says."""
    error: str | None = None
    try:
        yield
    except ClorchError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
        logger.debug("%s", failed, exc_info=True)
        error = f"{failed}: {type(exc).__name__}: {exc}"
    try:
        raise_if_any(gather(error, group), doing)
    except CheckpointError as exc:
        # raised while the block's own error is being handled (contextlib throws it in here): its
        # text is in this one, and the chain ("During handling of the above exception...") would
        # show the user clorch_repl's frames, which checkpoint errors never do (common/user_frames)
        raise exc from None
