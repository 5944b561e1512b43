"""What each rank saves of its own in either format: its RNG streams, and the caller's JSON map.

RNG states are kept as tensors and plain numbers, so ``torch.load(weights_only=True)`` reads them
back without unpickling any code. Every rank saves its own (torch CPU, CUDA where CUDA is
initialised, Python ``random``, NumPy) and resumes its own; a rank beyond the saved world size
resumes rank zero's, and is warned (:func:`borrowed_rng_message`): from then on it draws the same
random numbers as rank zero (dropout masks, augmentations), which nothing else would show.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from ...errors import ConfigError

__all__ = ["rng_state", "set_rng_state", "state_json", "entry_rank", "entry_for", "borrowed_rng_message"]


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as tensors (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(list(internal), dtype=torch.int64),
        "python_version": int(version),
        "python_gauss": gauss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA streams only where the GPU count matches)."""
    torch.set_rng_state(state["torch"].cpu())
    internal = tuple(int(v) for v in state["python"].tolist())
    random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        import numpy as np

        np.random.set_state((numpy_state["kind"], numpy_state["keys"].cpu().numpy().astype("uint32"),
                             int(numpy_state["pos"]), int(numpy_state["has_gauss"]),
                             float(numpy_state["cached_gaussian"])))


def state_json(state: Any) -> str:
    """The caller's ``state`` map as JSON text; ConfigError when it is not a JSON-able dict."""
    if state is None:
        state = {}
    if not isinstance(state, dict):
        raise ConfigError(f"state must be a dict (it is stored as JSON); got {type(state).__name__}")
    try:
        return json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"state must be JSON-serialisable (numbers, strings, lists, dicts): {exc}. "
                          "Convert tensors with .item() or .tolist() first") from None


def entry_rank(entries: list[Any], rank: int) -> int:
    """Whose entry of a per-rank list saved by every rank ``rank`` resumes: its own, or rank zero's
    past the list's end (the checkpoint came from fewer ranks)."""
    return rank if rank < len(entries) else 0


def entry_for(entries: list[Any], rank: int) -> Any:
    """This rank's entry of a per-rank list saved by every rank (:func:`entry_rank`)."""
    return entries[entry_rank(entries, rank)]


def borrowed_rng_message(rank: int, source: int, saved_ranks: int) -> str:
    """The one-line warning for ``rank``, which got rank ``source``'s RNG state (:func:`entry_rank`)
    from a checkpoint that ``saved_ranks`` ranks saved: what happened, why it matters, what to do."""
    return (f"load_checkpoint: rank {rank} resumed rank {source}'s random state (the checkpoint was saved by "
            f"{saved_ranks} rank{'s' if saved_ranks != 1 else ''}), so ranks {source} and {rank} now draw the same "
            "random numbers (dropout, augmentation); to make them differ, reseed after loading, e.g. "
            "torch.manual_seed(seed + rank)")
