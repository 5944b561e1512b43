"""``clorch_repl.parallel``, the API's name (API.md) for :mod:`clorch_repl.training.ddp`, where the code lives."""

from .training.ddp import distributed_data_parallel, no_sync, optimizer_step, parameter_signature, unwrap

__all__ = ["distributed_data_parallel", "no_sync", "optimizer_step", "unwrap", "parameter_signature"]
