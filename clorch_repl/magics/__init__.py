"""IPython magics of clorch_repl: ``%clorch`` (the ranks' lifecycle) and ``%%distributed``."""

from __future__ import annotations

from typing import Any

from .core import ClorchMagics

_registered: dict[int, ClorchMagics] = {}


def load(ipython: Any) -> None:
    magics = ClorchMagics(ipython)
    ipython.register_magics(magics)
    _registered[id(ipython)] = magics


def unload(ipython: Any) -> None:
    magics = _registered.pop(id(ipython), None)
    if magics is not None:
        magics.shutdown()


def magics_for(ipython: Any) -> ClorchMagics | None:
    """The loaded magics of a shell (tests and tools reach the session through it)."""
    return _registered.get(id(ipython))


__all__ = ["ClorchMagics", "load", "unload", "magics_for"]
