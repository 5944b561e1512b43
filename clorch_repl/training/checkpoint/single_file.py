"""The single-file format: an unsharded model's checkpoint, written by rank zero.

One file holds everything (:mod:`.container`): model weights, optimizer state, every rank's RNG
and sampler state, the scaler state and the JSON metadata. One file is one unit: new weights can
never sit beside old metadata. Model and optimizer states are taken from rank zero (identical on
every rank under DDP); each rank reads the file itself on loading, mapping tensors to its model's
device (so ranks do not all land on GPU 0).

Ranks: with an initialised process group both functions are collectives. Everything is checked
against the model, optimizer, sampler and scaler *before* any of them is changed, and the ranks
agree on success before returning (:mod:`.ranks`). "No pickled code" is about the file: the ranks
exchange their RNG and sampler states and their verdicts with ``all_gather_object``, which pickles
between the group's own processes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ...distributed import _c10d
from ...errors import CheckpointError, ClorchError, ConfigError
from ..ddp import unwrap
from .container import FORMAT, FORMAT_VERSION, read_container, write_container
from .extras import apply_extras, check_extras, checkpoint_metadata, local_extras, payload_extras, saved_state
from .ranks import gather, raise_if_any

logger = logging.getLogger(__name__)

__all__ = ["save", "load", "check_readable", "check_model_shapes", "check_optimizer_class"]


def save(target: str, model: Any, optimizer: Any, sampler: Any, scaler: Any, state: Any) -> str:
    """Write the single-file checkpoint from rank zero; every rank calls it."""
    local_error: str | None = None
    rng = sampler_state = None
    metadata_json = "{}"
    try:
        metadata_json, rng, sampler_state = local_extras(sampler, state)
        if os.path.isdir(target):
            raise ConfigError(f"{target} is a folder (a sharded checkpoint's, or another); give a file path "
                              f"such as {target}/model.pt, or pass sharded=True to save a sharded one there")
    except ClorchError as exc:
        local_error = str(exc)
    gathered = gather((local_error, rng, sampler_state))
    raise_if_any([g[0] for g in gathered], "saving the checkpoint")

    write_error: str | None = None
    if _c10d.rank() == 0:
        try:
            module = unwrap(model) if model is not None else None
            model_state = module.state_dict() if module is not None else None
            meta = checkpoint_metadata("single-file", metadata_json, model_state, model, optimizer, sampler,
                                       scaler)
            payload = {
                "format": FORMAT, "version": FORMAT_VERSION,
                "model": model_state,
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                **payload_extras(meta, scaler, sampler, [g[1] for g in gathered], [g[2] for g in gathered]),
            }
            write_container(target, payload)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
            logger.debug("writing the checkpoint %s failed", target, exc_info=True)
            write_error = f"writing {target} failed: {type(exc).__name__}: {exc}"
    raise_if_any(gather(write_error), "saving the checkpoint")
    return target


def _target_device(module: Any) -> torch.device:
    devices = {t.device for t in list(module.parameters()) + list(module.buffers())} if module is not None else set()
    if len(devices) == 1:
        return next(iter(devices))
    return torch.device("cpu")


def check_model_shapes(path: str, saved: dict[str, list[int]], current: dict[str, list[int]]) -> None:
    """CheckpointError naming the missing, unexpected and reshaped keys of a model's state
    (``saved`` and ``current``: name -> global shape), in both formats."""
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = [f"{k}: saved {saved[k]}, model {current[k]}" for k in current if k in saved and saved[k] != current[k]]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        if shapes:
            parts.append(f"different shapes ({'; '.join(shapes[:4])}{' ...' if len(shapes) > 4 else ''})")
        raise CheckpointError(f"the checkpoint {path} is from another model: {'; '.join(parts)}. "
                              "Build the model the checkpoint was saved from, or use a matching checkpoint")


def _check_model(path: str, saved: Any, module: Any) -> None:
    if not isinstance(saved, dict):
        raise CheckpointError(f"the checkpoint {path} holds no model weights; leave out model=")
    shape = lambda t: list(t.shape) if isinstance(t, torch.Tensor) else None  # noqa: E731
    check_model_shapes(path, {k: shape(v) for k, v in saved.items()},
                       {k: shape(v) for k, v in module.state_dict().items()})


def check_optimizer_class(path: str, saved_class: Any, optimizer: Any) -> None:
    """CheckpointError when the checkpoint holds another optimizer class's state."""
    if saved_class and saved_class != type(optimizer).__name__:
        raise CheckpointError(f"the checkpoint {path} holds {saved_class} state but the optimizer is "
                              f"{type(optimizer).__name__}; build the same optimizer to resume")


def _check_optimizer(path: str, saved: Any, optimizer: Any, saved_class: Any) -> None:
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        raise CheckpointError(f"the checkpoint {path} holds no optimizer state; leave out optimizer=")
    check_optimizer_class(path, saved_class, optimizer)
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"])
                                               for g, s in zip(groups, saved_groups)):
        raise CheckpointError(f"the checkpoint {path} has optimizer parameter groups of sizes "
                              f"{[len(s['params']) for s in saved_groups]} but this optimizer has "
                              f"{[len(g['params']) for g in groups]}; build the optimizer over the same "
                              "parameters")
    params = {sid: p for g, s in zip(groups, saved_groups) for sid, p in zip(s["params"], g["params"])}
    for sid, entry in saved["state"].items():
        param = params.get(sid)
        if param is None or not isinstance(entry, dict):
            raise CheckpointError(f"the checkpoint {path} has optimizer state for an unknown parameter {sid!r}")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"the checkpoint {path} has optimizer state {key!r} of shape "
                                      f"{list(value.shape)} for a parameter of shape {list(param.shape)}; "
                                      "it is from another model")


def _check_failure(source: str, exc: Exception) -> str:
    """What a rank reports when checking ``source`` raised ``exc``: a CheckpointError says it
    itself; anything else is unexpected, logged with its stack here."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    logger.debug("checking the checkpoint %s failed", source, exc_info=True)
    return f"the checkpoint {source} could not be checked: {type(exc).__name__}: {exc}"


def check_readable(source: str) -> None:
    """Raise on every rank, as :func:`load` does, unless ``source`` is a whole single-file checkpoint
    on every rank. For a caller about to refuse a real checkpoint for another reason (a sharded
    model): a file that is no checkpoint at all must be called that first, or the advice would be
    wrong. Its tensors are read onto the meta device, so the check holds no copy of the weights."""
    error: str | None = None
    try:
        read_container(source, torch.device("meta"))
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = _check_failure(source, exc)
    raise_if_any(gather(error), "loading the checkpoint")


def load(source: str, model: Any, optimizer: Any, sampler: Any, scaler: Any, restore_rng: bool) -> dict[str, Any]:
    """Restore a single-file checkpoint on every rank; returns its ``state`` map."""
    module = unwrap(model) if model is not None else None
    rank = _c10d.rank()
    error: str | None = None
    payload: dict[str, Any] = {}
    sampler_entry = None
    try:
        payload = read_container(source, _target_device(module))
        meta = payload["metadata"]
        if module is not None:
            _check_model(source, payload.get("model"), module)
        if optimizer is not None:
            _check_optimizer(source, payload.get("optimizer"), optimizer, meta.get("optimizer_class"))
        sampler_entry = check_extras(source, payload, sampler, scaler, restore_rng, rank)
    except Exception as exc:  # noqa: BLE001 - anything unexpected while validating counts as "does not fit"
        error = _check_failure(source, exc)
    raise_if_any(gather(error), "loading the checkpoint")

    try:
        if module is not None:
            module.load_state_dict(payload["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(payload["optimizer"])
        apply_extras(payload, sampler, scaler, sampler_entry, restore_rng, rank)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, its stack logged here
        logger.debug("applying the checkpoint %s failed", source, exc_info=True)
        error = f"applying the checkpoint {source} failed: {type(exc).__name__}: {exc}"
    raise_if_any(gather(error), "loading the checkpoint", changed=True)
    return saved_state(payload)
