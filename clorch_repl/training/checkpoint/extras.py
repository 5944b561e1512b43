"""The parts of a checkpoint beside the weights, the same in both formats: every rank's sampler
and RNG state, the grad scaler's state and the caller's JSON map.

Saving: :func:`local_extras` runs on every rank (its own RNG and sampler state, and the checks of
what it was given), :func:`payload_extras` builds what rank zero writes from every rank's part.
Loading: :func:`check_extras` checks them against the sampler and scaler *before* anything is
changed, :func:`apply_extras` restores them once every rank has said the checkpoint fits, and warns
a rank past the saved world size that it got rank zero's RNG state (:mod:`.rank_state`).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from ...common.user_frames import users_stacklevel
from ...errors import CheckpointError, ClorchError, ConfigError
from .rank_state import borrowed_rng_message, entry_for, entry_rank, rng_state, set_rng_state, state_json

__all__ = ["local_extras", "checkpoint_metadata", "payload_extras", "check_extras", "apply_extras", "saved_state"]


def local_extras(sampler: Any, state: Any) -> tuple[str, dict[str, Any], Any]:
    """(state as JSON, this rank's RNG state, its sampler state); ConfigError on bad input."""
    metadata_json = state_json(state)
    if sampler is not None and not callable(getattr(sampler, "state_dict", None)):
        raise ConfigError(f"sampler {type(sampler).__name__} has no state_dict(); use "
                          "clorch_repl.data.distributed_sampler, or leave sampler out")
    return metadata_json, rng_state(), sampler.state_dict() if sampler is not None else None


def checkpoint_metadata(layout: str, metadata_json: str, model_state: Any, model: Any, optimizer: Any,
                        sampler: Any, scaler: Any) -> dict[str, Any]:
    """The JSON metadata of a checkpoint of either ``layout`` ("single-file" or "sharded")."""
    import time

    import torch

    from ...distributed import _c10d
    from .container import FORMAT, FORMAT_VERSION

    signature = ([[name, list(t.shape), str(t.dtype).replace("torch.", "")]
                  for name, t in model_state.items() if isinstance(t, torch.Tensor)]
                 if model_state is not None else None)
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "layout": layout, "state": json.loads(metadata_json),
        "saved_at": time.time(), "torch": torch.__version__, "world_size": _c10d.world_size(),
        "model_signature": signature,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "contents": [name for name, obj in (("model", model), ("optimizer", optimizer),
                                            ("sampler", sampler), ("scaler", scaler)) if obj is not None],
    }


def payload_extras(meta: dict[str, Any], scaler: Any, sampler: Any,
                   rngs: list[Any], samplers: list[Any]) -> dict[str, Any]:
    """What a checkpoint file holds beside the weights, from every rank's :func:`local_extras`."""
    return {
        "metadata": json.dumps(meta),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "sampler": samplers if sampler is not None else None,
        "rng": rngs,
    }


def _check_scaler(path: str, saved: Any, scaler: Any) -> None:
    if saved is None:
        raise CheckpointError(f"the checkpoint {path} holds no grad scaler state; leave out scaler=")
    if scaler.is_enabled() and not saved:
        raise CheckpointError(f"the checkpoint {path} was saved with a disabled grad scaler (not a float16 "
                              "run); leave out scaler= or start the scale afresh")


def _check_sampler(path: str, saved: Any, sampler: Any, rank: int) -> Any:
    if not isinstance(saved, list) or not saved:
        raise CheckpointError(f"the checkpoint {path} holds no sampler state; leave out sampler=")
    entry = entry_for(saved, rank)
    check = getattr(sampler, "check_state_dict", None)
    if check is not None:
        try:
            check(entry)
        except ClorchError as exc:
            raise CheckpointError(f"the sampler state in {path} does not fit: {exc}") from None
    elif not callable(getattr(sampler, "load_state_dict", None)):
        raise CheckpointError(f"sampler {type(sampler).__name__} has no load_state_dict()")
    return entry


def check_extras(path: str, payload: dict[str, Any], sampler: Any, scaler: Any, restore_rng: bool,
                 rank: int) -> Any:
    """Check the saved scaler, sampler and RNG parts; returns this rank's sampler entry."""
    sampler_entry = None
    if scaler is not None:
        _check_scaler(path, payload.get("scaler"), scaler)
    if sampler is not None:
        sampler_entry = _check_sampler(path, payload.get("sampler"), sampler, rank)
    rngs = payload.get("rng")
    if restore_rng and (not isinstance(rngs, list) or not rngs or "torch" not in rngs[0]):
        raise CheckpointError(f"the checkpoint {path} holds no RNG state; pass restore_rng=False")
    return sampler_entry


def apply_extras(payload: dict[str, Any], sampler: Any, scaler: Any, sampler_entry: Any, restore_rng: bool,
                 rank: int) -> None:
    """Restore what :func:`check_extras` accepted."""
    if scaler is not None:
        scaler.load_state_dict(payload["scaler"])
    if sampler is not None:
        sampler.load_state_dict(sampler_entry)
    if restore_rng:
        rngs = payload["rng"]
        source = entry_rank(rngs, rank)
        set_rng_state(rngs[source])
        if source != rank:
            warnings.warn(borrowed_rng_message(rank, source, len(rngs)), RuntimeWarning,
                          stacklevel=users_stacklevel())


def saved_state(payload: dict[str, Any]) -> dict[str, Any]:
    """The caller's ``state`` map of a checkpoint's metadata (``{}`` when there is none)."""
    state = payload.get("metadata", {}).get("state", {})
    return state if isinstance(state, dict) else {}
