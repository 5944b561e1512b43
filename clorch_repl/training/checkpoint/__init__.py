"""Checkpoints of training state that a crash never leaves half-written and that load no pickled
code: model weights, optimizer state, every rank's RNG and sampler state, the grad scaler and the
caller's JSON ``state`` map.

Public names: ``clorch_repl.distributed.save_checkpoint`` / ``load_checkpoint`` (``dist.`` in
API.md). A checkpoint is training state, so it lives with :mod:`..ddp`, :mod:`..sampler` and
:mod:`..amp`, whose objects it saves.

Two formats, chosen by what is saved:

* **single file** (:mod:`.single_file`), for unsharded models (plain or DDP): rank zero writes one
  ``torch.save`` zip (:mod:`.container`);
* **sharded** (:mod:`.sharded`), when the model's or the optimizer's state holds DTensors (FSDP2,
  tensor parallel, 2-D meshes) or the model is wrapped in FSDP1, or with ``sharded=True``: a folder in torch.distributed.checkpoint's
  format, every rank writing its own shards, committed across ranks by one rename
  (:mod:`.commit`), loadable on any number of ranks and into an unsharded model without a group,
  its metadata read through an allow-list (:mod:`.safe_dcp`). ``async_save=True`` returns once the
  state is in host memory (:mod:`.staging`, :mod:`.in_flight`).

Loading picks the format from the path: a folder is sharded, a file is a single file. With an
initialised process group both functions are collectives (every rank calls them) and the ranks
agree on the outcome (:mod:`.ranks`): a failure on one rank raises on every rank, naming it.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import CheckpointError, ConfigError
from ...common.user_frames import public
from . import in_flight, single_file
from . import sharded as sharded_format
from .container import read_container
from .in_flight import CheckpointSave

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint_metadata", "CheckpointError", "CheckpointSave",
           "saves_in_flight"]


@public
def save_checkpoint(path: str | os.PathLike[str], model: Any = None, optimizer: Any = None,
                    sampler: Any = None, scaler: Any = None, state: dict[str, Any] | None = None, *,
                    sharded: bool | None = None, async_save: bool = False) -> str | CheckpointSave:
    """Save a checkpoint at ``path``; every rank must call it. Returns the absolute path, or with
    ``async_save=True`` a :class:`CheckpointSave` handle (``wait()``, ``done()``).

    ``sharded``: None (the default) saves the sharded format exactly when the model is sharded (its
    parameters or the optimizer's state hold DTensors, or it is wrapped in FSDP1); True saves it for any model; False refuses a sharded model (its single file
    would hold rank zero's shards only). ``state`` must be JSON-serialisable; :func:`load_checkpoint`
    returns it. With ``async_save`` the checkpoint holds the state at the call; a second save (or a
    load) on the rank waits for the first.
    """
    target = os.path.abspath(os.fspath(path))
    if sharded not in (None, True, False):
        raise ConfigError(f"sharded must be True, False or None (decide from the model); got {sharded!r}")
    if not isinstance(async_save, bool):
        raise ConfigError(f"async_save must be True or False; got {async_save!r}")
    holds = sharded_format.holds_shards(model, optimizer)
    if sharded is False and holds:
        raise ConfigError("the model is sharded (FSDP2, tensor parallel or FSDP1), so a single file "
                          "would keep only rank 0's shards: leave sharded= out (or pass True) to save a sharded "
                          "checkpoint folder")
    if sharded or holds:
        return sharded_format.save(target, model, optimizer, sampler, scaler, state, async_save)
    if async_save:
        raise ConfigError("async_save=True writes the sharded format: pass sharded=True as well (the "
                          "single-file format is written by rank 0 alone, in the call)")
    in_flight.wait_for_previous()
    return single_file.save(target, model, optimizer, sampler, scaler, state)


@public
def load_checkpoint(path: str | os.PathLike[str], model: Any = None, optimizer: Any = None,
                    sampler: Any = None, scaler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns its ``state`` map. Every rank must call it.

    A folder is a sharded checkpoint: it loads into the model however it is sharded now (any
    number of ranks, FSDP2, tensor parallel, or an unsharded model, also in a process without a
    process group). Each rank restores its own saved RNG and sampler state (rank zero's when the
    checkpoint came from fewer ranks). A rank given rank zero's RNG state is warned (a
    RuntimeWarning naming both ranks): it would otherwise draw the same dropout masks and
    augmentations as rank zero unnoticed; reseed it after loading (``torch.manual_seed(seed +
    rank)``) if they should differ. Nothing is changed on any rank unless every rank validated the
    checkpoint.
    """
    source = os.path.abspath(os.fspath(path))
    in_flight.wait_for_previous()  # the save that makes or replaces it may still be writing
    layout = _layout_on_every_rank(source)
    if layout == "folder":
        return sharded_format.load(source, model, optimizer, sampler, scaler, restore_rng)
    if layout == "missing":  # before the format's own rules: a sharded model was told to load "a single file"
        raise CheckpointError(sharded_format.missing_target_message(source))
    if sharded_format.holds_shards(model, optimizer):
        single_file.check_readable(source)  # a file that is no checkpoint is said to be none, not an unsharded one
        raise ConfigError(f"{source} is a single-file checkpoint (an unsharded model's) and the model is sharded "
                          "(FSDP2, tensor parallel or FSDP1): load it into the unsharded model, then shard it, or save "
                          "the sharded model with save_checkpoint to get a sharded checkpoint")
    return single_file.load(source, model, optimizer, sampler, scaler, restore_rng)


def _layout_on_every_rank(source: str) -> str:
    """"folder", "file" or "missing", as every rank sees ``source``; the ranks must agree, or they
    would each take another format's collectives and wait for each other forever."""
    from ...distributed import _c10d
    from ...errors import rank_words
    from .ranks import gather

    mine = "folder" if os.path.isdir(source) else "file" if os.path.exists(source) else "missing"
    if not _c10d.active() or _c10d.world_size() == 1:
        return mine
    seen = gather(mine)
    if len(set(seen)) > 1:
        views = "; ".join(f"{rank_words(r for r, v in enumerate(seen) if v == view)}: {view}"
                          for view in sorted(set(seen)))
        raise CheckpointError(f"the ranks see {source} differently ({views}): a checkpoint must be on a "
                              "filesystem that every rank's host shares; nothing was loaded")
    return mine


@public
def read_checkpoint_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON metadata of a checkpoint (its ``state`` map, torch version, contents, layout) without
    loading it."""
    import torch

    source = os.path.abspath(os.fspath(path))
    if os.path.isdir(source):
        source = os.path.join(source, sharded_format.EXTRAS_FILE)
    return read_container(source, torch.device("cpu"))["metadata"]


def saves_in_flight() -> list[dict[str, Any]]:
    """This rank's asynchronous save still writing (path, seconds), for ``%clorch status``."""
    return in_flight.in_flight()
