"""Mixed precision: autocast and dynamic loss scaling through torch.amp, with the seed's words.

Public name: ``clorch_repl.amp`` (``from clorch_repl import amp``).

bfloat16 keeps float32's exponent range, so gradients do not underflow and no scaler is needed.
float16 does underflow: its loss is multiplied by a dynamic scale before backward, and a step whose
gradients overflowed is skipped while the scale backs off. In a multi-rank run every rank must
agree on that skip; :func:`clorch_repl.parallel.optimizer_step` makes them agree.

Everything goes through ``torch.amp`` (``torch.autocast``, ``torch.amp.GradScaler``), never the
deprecated ``torch.cuda.amp`` entry points, so no deprecation warning reaches the user.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..errors import ConfigError

__all__ = ["grad_scaler", "autocast", "backward", "needs_scaler", "resolve_dtype", "default_device"]

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float16"``/``"bfloat16"``/``"float32"`` (or a torch dtype) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float16, torch.bfloat16, torch.float32):
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ConfigError(f"precision must be float16, bfloat16 or float32; got {dtype!r}")


def needs_scaler(dtype: str | torch.dtype) -> bool:
    """Only float16 needs loss scaling (its exponent range makes small gradients underflow)."""
    return resolve_dtype(dtype) == torch.float16


def default_device() -> str:
    """``"cuda"`` where this process can use a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_type(device: str | torch.device | None) -> str:
    if device is None:
        return default_device()
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be 'cuda', 'cpu' or a torch.device; got {device!r}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but this process has no usable GPU; "
                          "use device='cpu' (or leave it out)")
    return kind


def grad_scaler(initial_scale: float = 65536.0, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                growth_interval: int = 2000, enabled: bool = True,
                device: str | torch.device | None = None) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for float16 training (on ``device``: the GPU when there is one).

    Returned as torch's own object so it works with anything that expects one. Pass it to
    :func:`backward` and to :func:`clorch_repl.parallel.optimizer_step`.
    """
    try:
        scale = float(initial_scale)
    except (TypeError, ValueError):
        raise ConfigError(f"initial_scale must be a positive number; got {initial_scale!r}") from None
    if not scale > 0 or scale == float("inf"):
        raise ConfigError(f"initial_scale must be a positive finite number; got {initial_scale!r}")
    if not float(growth_factor) > 1.0:
        raise ConfigError(f"growth_factor must be greater than 1; got {growth_factor!r}")
    if not 0.0 < float(backoff_factor) < 1.0:
        raise ConfigError(f"backoff_factor must be between 0 and 1; got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ConfigError(f"growth_interval must be a whole number of steps >= 1; got {growth_interval!r}")
    return torch.amp.GradScaler(_device_type(device), init_scale=scale, growth_factor=float(growth_factor),
                                backoff_factor=float(backoff_factor), growth_interval=growth_interval,
                                enabled=bool(enabled))


@contextlib.contextmanager
def autocast(device: str | torch.device | None = None, dtype: str | torch.dtype = "bfloat16",
             enabled: bool = True) -> Iterator[None]:
    """Run the block's eligible ops in ``dtype``; ``"float32"`` (or ``enabled=False``) runs it as is.

    Accepting float32 lets one training loop take the precision as a parameter.
    """
    kind = _device_type(device)
    resolved = resolve_dtype(dtype)
    if not enabled or resolved == torch.float32:
        yield
        return
    with torch.autocast(device_type=kind, dtype=resolved):
        yield


def backward(scaler: torch.amp.GradScaler | None, loss: torch.Tensor) -> None:
    """``loss.backward()``, through the scaler's loss scale when there is an enabled scaler.

    ``scaler=None`` is allowed so that the same line serves bfloat16 and float32 runs.
    """
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"backward needs the loss tensor; got {type(loss).__name__}")
    if scaler is not None and scaler.is_enabled():
        scaler.scale(loss).backward()
    else:
        loss.backward()
