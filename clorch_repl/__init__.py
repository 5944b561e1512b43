"""clorch_repl: drive multi-GPU PyTorch from a Jupyter notebook.

``%load_ext clorch_repl`` registers ``%clorch`` and ``%%distributed``. The Python API lives in the
submodules ``cuda``, ``distributed``, ``parallel``, ``data`` and ``amp`` (the last three are the
API's names for the parts of :mod:`clorch_repl.training`), and every error it raises on purpose in
``errors``; they are imported on first use so that loading the extension stays fast and never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["cuda", "distributed", "parallel", "data", "amp", "training", "errors", "load_ipython_extension",
           "unload_ipython_extension"]

_LAZY = {"cuda", "distributed", "parallel", "data", "amp", "training", "errors"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext clorch_repl``: register ``%clorch`` and ``%%distributed``."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext clorch_repl``: stop the ranks this extension started."""
    from .magics import unload

    unload(ipython)
