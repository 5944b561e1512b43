"""The sharded format: a folder in torch.distributed.checkpoint's (DCP) layout, every rank writing
its own shards, committed across ranks in one rename.

Used when the model's or the optimizer's state holds DTensors (FSDP2 ``fully_shard``, tensor
parallelism, 2-D meshes) or the model is wrapped in FSDP1's ``FullyShardedDataParallel``, or with ``sharded=True``. The folder::

    PATH/
      .metadata          DCP's index of every tensor's shards (written by rank zero)
      __0_0.distcp ...   each rank's shards (DCP's file names)
      clorch.pt          every rank's RNG and sampler state, the scaler, the JSON metadata
                         (:mod:`.container`, read with weights_only)

The DCP state is ``{"model": ..., "optimizer": ...}`` as torch's ``get_state_dict`` gives it
(parameter names, not indices, so it fits any wrapping and any number of ranks), which is what
``dcp.load``, ``format_utils.dcp_to_torch_save`` and torchtitan-style loaders read.

Saving (every rank): checks, RNG and sampler states gathered; rank zero makes the temporary folder
beside the target (:mod:`.commit`) and writes ``clorch.pt``; every rank writes its shards there
(``dcp.save``, fsynced files); rank zero checks every file the ranks wrote is there whole (so a
folder that is not shared by every rank's host fails, naming the files), and commits; the ranks
agree on the outcome. With ``async_save`` the state is first copied to host memory shared with
the rank's writer process (:mod:`.staging`), the planning and commit run on a thread
(:mod:`.in_flight`), and the shard files are written by that process (:mod:`.writer_process`),
which keeps their Python off the GIL the training steps need.

Loading (every rank, or one process without a group): the metadata is read through an
allow-list (:mod:`.safe_dcp`), the model's names and global shapes are checked against it, the
files are checked to be there, every rank agrees, and only then ``dcp.load`` fills the model's
own state (resharding to however it is sharded now) and ``set_state_dict`` applies it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import time
import warnings
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor

from ...distributed import _c10d
from ...errors import CheckpointError, ClorchError, ConfigError
from . import in_flight, save_plans
from .commit import check_replaceable, commit, leftover_of, missing_files, remove_leftovers, temp_folder
from .container import FORMAT, FORMAT_VERSION, is_torch_file, read_container, write_container
from .extras import apply_extras, check_extras, checkpoint_metadata, local_extras, payload_extras, saved_state
from .ranks import agreed, checkpoint_group, gather, raise_if_any
from .safe_dcp import METADATA_FILE, SafeLoadPlanner, SafeReader, read_metadata
from .single_file import check_model_shapes, check_optimizer_class
from .staging import Stager
from .storage_writers import ProcessWriter, RecordingWriter
from .writer_process import WriterProcess

logger = logging.getLogger(__name__)

__all__ = ["EXTRAS_FILE", "holds_shards", "save", "load", "leftover_of", "missing_target_message"]

EXTRAS_FILE = "clorch.pt"
_WRITER = WriterProcess()
atexit.register(_WRITER.close)
_STAGER = Stager(before_new_block=_WRITER.forget_block)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP runs in one process and warns that it assumes so: loading into
    the notebook's own kernel is what this package means to do, so that warning is dropped."""
    with warnings.catch_warnings():
        if not _c10d.active():
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized",
                                    category=UserWarning)
        yield


def holds_shards(model: Any, optimizer: Any) -> bool:
    """Whether the model's parameters or buffers, or the optimizer's state, hold DTensors (FSDP2,
    tensor parallel), or the model is wrapped in FSDP1's ``FullyShardedDataParallel``: each rank
    holds only its part, and a state dict of the whole model takes collectives on every rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ..ddp import unwrap

    if model is not None:
        module = unwrap(model)
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            return True
        if any(isinstance(t, DTensor) for t in (*module.parameters(), *module.buffers())):
            return True
    if optimizer is not None:
        return any(isinstance(v, DTensor) for entry in optimizer.state.values() for v in entry.values())
    return False


def _require_model(model: Any, optimizer: Any) -> None:
    if optimizer is not None and model is None:
        raise ConfigError("a sharded checkpoint keeps the optimizer's state by parameter name: pass model= "
                          "with optimizer=")


def _dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The ``{"model", "optimizer"}`` state DCP saves and loads, by parameter name."""
    if model is None:
        return {}
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _dcp_error_text(exc: BaseException) -> str:
    """One line per rank of what DCP raised (its CheckpointException carries every rank's failure,
    the first of which may be a CheckpointError of :mod:`.safe_dcp`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
            if isinstance(cause, CheckpointError):
                return str(cause)
            parts.append(f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}")
        return "; ".join(parts)
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


# -- save ----------------------------------------------------------------------------------------

def save(target: str, model: Any, optimizer: Any, sampler: Any, scaler: Any, state: Any,
         async_save: bool) -> str | in_flight.CheckpointSave:
    """Write a sharded checkpoint at ``target``; every rank calls it (see the module's docstring)."""
    in_flight.wait_for_previous()
    called_at = time.perf_counter()
    group = checkpoint_group()
    rank = _c10d.rank()
    local_error: str | None = None
    rng = sampler_state = None
    metadata_json = "{}"
    dcp_state: dict[str, Any] = {}
    shapes = ""
    # Agreed before the state dict is taken (see ranks.agreed: FSDP1's takes collectives).
    with agreed("saving the checkpoint", "preparing the checkpoint failed", group):
        metadata_json, rng, sampler_state = local_extras(sampler, state)
        _require_model(model, optimizer)
        if rank == 0:
            check_replaceable(target, is_torch_file(target))
    try:
        dcp_state = _dcp_state(model, optimizer)
        shapes = save_plans.fingerprint(dcp_state)
        if async_save:
            dcp_state = _STAGER.stage(dcp_state)
    except ClorchError as exc:
        local_error = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
        logger.debug("preparing the checkpoint %s failed", target, exc_info=True)
        local_error = f"preparing the state failed: {type(exc).__name__}: {exc}"
    gathered = gather((local_error, rng, sampler_state, shapes), group)
    raise_if_any([g[0] for g in gathered], "saving the checkpoint")
    plan_key = save_plans.plan_key(group, [g[3] for g in gathered])

    temp: str | None = None
    error: str | None = None
    if rank == 0:
        try:
            remove_leftovers(target)
            temp = temp_folder(target)
            meta = checkpoint_metadata("sharded", metadata_json, dcp_state.get("model"), model, optimizer, sampler,
                                       scaler)
            write_container(os.path.join(temp, EXTRAS_FILE), {
                "format": FORMAT, "version": FORMAT_VERSION, "model": None, "optimizer": None,
                **payload_extras(meta, scaler, sampler, [g[1] for g in gathered], [g[2] for g in gathered])})
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
            logger.debug("starting the checkpoint %s failed", target, exc_info=True)
            error = f"starting the checkpoint in {os.path.dirname(target)} failed: {type(exc).__name__}: {exc}"
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)
    temp, error = gather((temp, error), group)[0]  # rank zero's folder, or its error, to every rank
    raise_if_any([error] + [None] * (_c10d.world_size() - 1), "saving the checkpoint")

    arena = _STAGER.arena

    def write() -> str:
        # An asynchronous save writes its shards in the writer process, out of the steps' GIL.
        writer = ProcessWriter(temp, _WRITER, arena) if async_save else RecordingWriter(temp)
        _write_and_commit(dcp_state, writer, plan_key, temp, target, group)
        return target

    if not async_save:
        return write()
    return in_flight.start(target, time.perf_counter() - called_at, write)


def _write_and_commit(dcp_state: dict[str, Any], writer: RecordingWriter, plan_key: str, temp: str, target: str,
                      group: Any) -> None:
    error: str | None = None
    try:
        with _single_process_quiet():
            dcp.save(dcp_state, storage_writer=writer, planner=save_plans.planner(plan_key), process_group=group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank; agreed below
        logger.debug("dcp.save into %s failed", temp, exc_info=True)
        error = f"writing the shards failed ({_dcp_error_text(exc)})"
    if error is None and _c10d.rank() == 0:
        try:
            missing = missing_files(temp, writer.files())
            if missing:
                raise CheckpointError(
                    f"rank 0 does not see {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} in {temp}: "
                    "a sharded checkpoint needs a folder that every rank's host shares (the same filesystem)")
            commit(temp, target)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
            logger.debug("committing %s failed", target, exc_info=True)
            error = str(exc) if isinstance(exc, CheckpointError) else f"committing {target} failed: {exc}"
    errors = gather(error, group)
    if any(errors):
        save_plans.forget()  # every rank sees the failure: no rank keeps a plan the others dropped
    if any(errors) and _c10d.rank() == 0 and os.path.isdir(temp):
        shutil.rmtree(temp, ignore_errors=True)
    raise_if_any(errors, "saving the checkpoint")


# -- load ----------------------------------------------------------------------------------------

def _saved_shapes(metadata: Any, top: str) -> dict[str, list[int]]:
    """name -> global shape of the tensors saved under ``top`` ("model")."""
    shapes: dict[str, list[int]] = {}
    paths = getattr(metadata, "planner_data", None) or {}
    for key, entry in metadata.state_dict_metadata.items():
        path = paths.get(key)
        if path is not None:
            if len(path) < 2 or path[0] != top:
                continue
            name = ".".join(str(p) for p in path[1:])
        elif key.startswith(top + "."):
            name = key[len(top) + 1:]
        else:
            continue
        size = getattr(entry, "size", None)
        shapes[name] = list(size) if size is not None else None
    return shapes


def _check(source: str, folder: str, metadata: Any, extras: dict[str, Any], model: Any, optimizer: Any,
           dcp_state: dict[str, Any]) -> None:
    if model is not None:
        saved = _saved_shapes(metadata, "model")
        if not saved:
            raise CheckpointError(f"the checkpoint {source} holds no model weights; leave out model=")
        current = {k: (list(v.shape) if isinstance(v, torch.Tensor) else None)
                   for k, v in dcp_state["model"].items()}
        check_model_shapes(source, saved, current)
    if optimizer is not None:
        if not _saved_shapes(metadata, "optimizer"):
            raise CheckpointError(f"the checkpoint {source} holds no optimizer state; leave out optimizer=")
        check_optimizer_class(source, extras.get("metadata", {}).get("optimizer_class"), optimizer)
    missing = missing_files(folder, metadata)
    if missing:
        raise CheckpointError(f"the checkpoint {source} lacks {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}: it is incomplete; use an earlier checkpoint")


@contextlib.contextmanager
def _pinned(folder: str) -> Iterator[str]:
    """A path that names this very folder for the whole load, even if a save swaps another in at
    ``folder`` meanwhile (Linux: through an open descriptor of it); the metadata and the shards
    then always come from one checkpoint. Elsewhere, ``folder`` itself."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield folder
        return
    try:
        alias = f"/proc/self/fd/{fd}"
        yield alias if os.path.isfile(os.path.join(alias, METADATA_FILE)) else folder
    finally:
        os.close(fd)


def load(source: str, model: Any, optimizer: Any, sampler: Any, scaler: Any, restore_rng: bool) -> dict[str, Any]:
    """Restore a sharded checkpoint on every rank (or in one process); returns its ``state`` map."""
    with _pinned(source) as folder:
        return _load(source, folder, model, optimizer, sampler, scaler, restore_rng)


def _load(source: str, folder: str, model: Any, optimizer: Any, sampler: Any, scaler: Any,
          restore_rng: bool) -> dict[str, Any]:
    in_flight.wait_for_previous()
    group = checkpoint_group()
    rank = _c10d.rank()
    extras: dict[str, Any] = {"metadata": {}}  # a checkpoint without extras (torch's own dcp.save)
    # Read once, then checked against and handed to DCP's reader: each read of the metadata and
    # each state dict of a large model costs a measurable share of the load. What only reads files
    # is agreed on before the state dict is taken (see ranks.agreed: FSDP1's takes collectives).
    with agreed("loading the checkpoint", f"the checkpoint {source} could not be read", group):
        metadata = read_metadata(folder, name=source)
        extras_path = os.path.join(folder, EXTRAS_FILE)
        if os.path.exists(extras_path):
            extras = read_container(extras_path, torch.device("cpu"))
        _require_model(model, optimizer)
        sampler_entry = check_extras(source, extras, sampler, scaler, restore_rng, rank)
    with agreed("loading the checkpoint", f"the checkpoint {source} could not be checked", group):
        dcp_state = _dcp_state(model, optimizer)
        _check(source, folder, metadata, extras, model, optimizer, dcp_state)

    error: str | None = None
    try:
        if dcp_state:
            with _single_process_quiet():
                dcp.load(dcp_state, storage_reader=SafeReader(folder, metadata), planner=SafeLoadPlanner(),
                         process_group=group)
            if optimizer is not None:
                set_state_dict(model, optimizer, model_state_dict=dcp_state["model"],
                               optim_state_dict=dcp_state["optimizer"])
            else:
                set_model_state_dict(model, dcp_state["model"])
        apply_extras(extras, sampler, scaler, sampler_entry, restore_rng, rank)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported to every rank below
        logger.debug("applying the checkpoint %s failed", source, exc_info=True)
        error = (str(exc) if isinstance(exc, CheckpointError)
                 else f"applying the checkpoint {source} failed: {_dcp_error_text(exc)}")
    raise_if_any(gather(error, group), "loading the checkpoint", changed=True)
    return saved_state(extras)


def missing_target_message(source: str) -> str:
    """What to say when ``source`` does not exist: naming a whole checkpoint a cut commit left."""
    left = leftover_of(source)
    if left is not None:
        return (f"no checkpoint at {source}, but a whole one is beside it at {left}: a save was cut between "
                f"moving the old checkpoint aside and the new one in; rename it to {source} to use it")
    return f"no checkpoint at {source}: check the path, or save one first"
