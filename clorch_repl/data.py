"""``clorch_repl.data``, the API's name (API.md) for :mod:`clorch_repl.training.sampler`, where the code lives."""

from .training.sampler import DistributedSampler, SameEpochWarning, distributed_sampler

__all__ = ["DistributedSampler", "distributed_sampler", "SameEpochWarning"]
