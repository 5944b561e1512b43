"""``clorch_repl.amp``, the API's name (API.md) for :mod:`clorch_repl.training.amp`, where the code lives."""

from .training.amp import autocast, backward, default_device, grad_scaler, needs_scaler, resolve_dtype

__all__ = ["grad_scaler", "autocast", "backward", "needs_scaler", "resolve_dtype", "default_device"]
