"""Distributed sampling that survives a restart.

Public name: ``clorch_repl.data`` (``from clorch_repl import data``).

Each rank gets a disjoint, deterministic share of the data set. The permutation is exactly torch's
``DistributedSampler`` (``randperm`` seeded with ``seed + epoch``, padded by wrapping around or
truncated with ``drop_last``, then every ``num_replicas``-th index from ``rank``), so results match
code written against torch. What torch lacks, and a notebook needs after ``%clorch restart``, is
the position within the epoch: :meth:`DistributedSampler.state_dict` holds it, so a resumed run
continues with the very next batch instead of replaying or skipping the rest of an epoch.

How the position advances: iterating the sampler (``iter(sampler)``, which is what a DataLoader,
a ``BatchSampler`` or a ``for`` loop does) counts every index it hands out. With a DataLoader
without worker processes (``num_workers=0``), after the training step on batch ``k`` the position
is exactly ``(k + 1) * batch_size``. Worker processes prefetch indices ahead of training; with them,
set :attr:`DistributedSampler.position` to the number of samples actually trained on before
saving. :meth:`DistributedSampler.sample_indices` is the full list for the epoch and moves
nothing.

Epochs: ``set_epoch(e)`` with a new ``e`` starts that epoch from its beginning; with the current
``e`` it keeps the position, so the usual ``for epoch in range(start, n): sampler.set_epoch(epoch)``
loop resumes mid-epoch after ``load_state_dict``. Iterating an epoch that was already finished
without calling ``set_epoch`` warns (and replays the same permutation, as torch would).
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from ..common.user_frames import public
from ..errors import ConfigError

__all__ = ["DistributedSampler", "distributed_sampler", "SameEpochWarning"]

_STATE_VERSION = 1


class SameEpochWarning(UserWarning):
    """An epoch is iterated again without ``set_epoch``: the shuffle repeats."""


def _int_arg(value: Any, what: str, minimum: int) -> int:
    """A whole number (int, numpy integer or, from the environment, a string) >= ``minimum``."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ConfigError(f"{what} must be a whole number; got {value!r}")
    try:
        number = int(value) if isinstance(value, str) else int(value.__index__())
    except (AttributeError, TypeError, ValueError):
        raise ConfigError(f"{what} must be a whole number; got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{what} must be at least {minimum}; got {number}")
    return number


def _from_env(name: str, what: str, minimum: int) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"{what} was not given and {name} is not set: pass {what}=..., or run inside "
                          "a %%distributed cell or a launch() worker, where it is set")
    try:
        return _int_arg(value.strip(), f"{name} (from the environment)", minimum)
    except ConfigError:
        raise ConfigError(f"{name}={value!r} in the environment is not a whole number >= {minimum}; "
                          f"pass {what}=... explicitly") from None


def _size_of(dataset_size: Any) -> int:
    """The number of samples: a whole number, or a dataset's ``len()`` (torch's own
    DistributedSampler takes the dataset, and code brought from it passes one)."""
    if not hasattr(dataset_size, "__index__") and not isinstance(dataset_size, (str, float)) \
            and hasattr(dataset_size, "__len__"):
        return len(dataset_size)
    return _int_arg(dataset_size, "dataset_size", 0)


class DistributedSampler(Sampler[int]):
    """One rank's share of ``range(dataset_size)``, reshuffled per epoch, resumable mid-epoch.
    ``dataset_size``: the number of samples, or the dataset itself (its ``len()``), as torch's
    DistributedSampler takes it."""

    @public
    def __init__(self, dataset_size: Any, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 1337, shuffle: bool = True, drop_last: bool = False) -> None:
        self.dataset_size = _size_of(dataset_size)
        self.num_replicas = (_from_env("WORLD_SIZE", "num_replicas", 1) if num_replicas is None
                             else _int_arg(num_replicas, "num_replicas", 1))
        self.rank = _from_env("RANK", "rank", 0) if rank is None else _int_arg(rank, "rank", 0)
        if self.rank >= self.num_replicas:
            raise ConfigError(f"rank {self.rank} is out of range for num_replicas {self.num_replicas} "
                              f"(ranks are 0..{self.num_replicas - 1})")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an integer; got {seed!r}")
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._position = 0
        self._epoch_consumed = False  # the current epoch was iterated to its end
        self._cache: tuple[tuple[int, int, bool, bool], list[int]] | None = None

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Indices this rank gets per epoch (the same on every rank)."""
        n, r = self.dataset_size, self.num_replicas
        if self.drop_last and n % r:
            return math.ceil((n - r) / r)
        return math.ceil(n / r)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    # -- position ---------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """How many of this epoch's indices were handed out (what a resumed run skips)."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        value = _int_arg(value, "position", 0)
        if value > self.num_samples:
            raise ConfigError(f"position {value} is past the end of the epoch ({self.num_samples} "
                              "samples on this rank)")
        self._position = value

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle to use; a different epoch starts from its beginning."""
        epoch = _int_arg(epoch, "epoch", 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self._position = 0
        if self._position >= self.num_samples:
            self._position = 0
        self._epoch_consumed = False

    # -- indices ----------------------------------------------------------------------------
    def sample_indices(self) -> list[int]:
        """This rank's indices for the current epoch, from its start (does not move the position)."""
        key = (self.epoch, self.seed, self.shuffle, self.drop_last)
        if self._cache is not None and self._cache[0] == key:
            return list(self._cache[1])
        n = self.dataset_size
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        total = self.total_size
        if not self.drop_last:
            padding = total - len(indices)
            if padding > 0 and indices:
                repeats = math.ceil(padding / len(indices))
                indices += (indices * repeats)[:padding]
        else:
            indices = indices[:total]
        mine = indices[self.rank:total:self.num_replicas]
        self._cache = (key, mine)
        return list(mine)

    def __iter__(self) -> Iterator[int]:
        if self._epoch_consumed or (self._position >= self.num_samples and self.num_samples > 0):
            warnings.warn(f"epoch {self.epoch} of the sampler on rank {self.rank} is iterated again "
                          "without set_epoch, so it repeats the same shuffle; call "
                          "sampler.set_epoch(epoch) before every epoch", SameEpochWarning, stacklevel=2)
            self._position = 0
            self._epoch_consumed = False
        indices = self.sample_indices()
        return self._walk(indices)

    def _walk(self, indices: list[int]) -> Iterator[int]:
        epoch = self.epoch
        while self._position < len(indices) and self.epoch == epoch:
            index = indices[self._position]
            self._position += 1
            yield index
        if self.epoch == epoch and self._position >= len(indices):
            self._position = 0
            self._epoch_consumed = True

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools (safe for ``torch.load(weights_only=True)``)."""
        position = self._position
        if self._epoch_consumed:
            position = self.num_samples
        return {"version": _STATE_VERSION, "epoch": self.epoch, "seed": self.seed, "rank": self.rank,
                "num_replicas": self.num_replicas, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "position": position, "dataset_size": self.dataset_size}

    def check_state_dict(self, state: Any) -> dict[str, Any]:
        """Validate a saved state against this sampler without changing anything; returns it cleaned.

        Adopted on load: epoch, position, seed, shuffle, drop_last (the run being resumed decides
        the permutation). Must match: dataset_size and num_replicas (a different split would
        replay or skip samples). ``rank`` is this sampler's own: every rank resumes its own share.
        """
        required = ("epoch", "seed", "num_replicas", "shuffle", "drop_last", "position", "dataset_size")
        if not isinstance(state, dict) or any(k not in state for k in required):
            missing = [k for k in required if not isinstance(state, dict) or k not in state]
            raise ConfigError(f"not a sampler state: missing {', '.join(missing)}")
        clean = {k: state[k] for k in required}
        for key in ("epoch", "position", "dataset_size", "num_replicas"):
            value = clean[key]
            if isinstance(value, torch.Tensor):
                value = int(value.item())
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"sampler state has an invalid {key}: {state[key]!r}")
            clean[key] = value
        if clean["dataset_size"] != self.dataset_size:
            raise ConfigError(f"the saved sampler covered {clean['dataset_size']} samples but this one covers "
                              f"{self.dataset_size}; resume with the same data set")
        if clean["num_replicas"] != self.num_replicas:
            raise ConfigError(f"the saved sampler was split over {clean['num_replicas']} ranks but this one "
                              f"over {self.num_replicas}; resume with the same number of ranks")
        if clean["position"] > self.num_samples:
            raise ConfigError(f"the saved position {clean['position']} is past the end of the epoch "
                              f"({self.num_samples} samples per rank)")
        if isinstance(clean["seed"], bool) or not isinstance(clean["seed"], int):
            raise ConfigError(f"sampler state has an invalid seed: {clean['seed']!r}")
        clean["shuffle"] = bool(clean["shuffle"])
        clean["drop_last"] = bool(clean["drop_last"])
        return clean

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the saved run stopped (see :meth:`check_state_dict` for what must match)."""
        clean = self.check_state_dict(state)
        self.seed = clean["seed"]
        self.shuffle = clean["shuffle"]
        self.drop_last = clean["drop_last"]
        self.epoch = clean["epoch"]
        self._cache = None
        self._position = clean["position"]
        self._epoch_consumed = False

    def __repr__(self) -> str:
        return (f"DistributedSampler(dataset_size={self.dataset_size}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, "
                f"epoch={self.epoch}, position={self._position})")


@public
def distributed_sampler(dataset_size: Any, num_replicas: int | None = None, rank: int | None = None,
                        seed: int = 1337, shuffle: bool = True, drop_last: bool = False) -> DistributedSampler:
    """A :class:`DistributedSampler`; ``num_replicas``/``rank`` default to WORLD_SIZE/RANK;
    ``dataset_size`` is the number of samples or the dataset (its ``len()``).

    Reading the environment rather than the process group means the sampler can be built before
    (or without) ``init_process_group``, e.g. to size a DataLoader.
    """
    return DistributedSampler(dataset_size, num_replicas=num_replicas, rank=rank, seed=seed,
                              shuffle=shuffle, drop_last=drop_last)
