"""IPython magics of clorch_repl: ``%clorch`` (the ranks' lifecycle) and ``%%distributed``."""

from __future__ import annotations

import atexit
from typing import Any

from .core import ClorchMagics

_registered: dict[int, ClorchMagics] = {}
#: where the last unload's stop kept each shell's rank logs: ``%clorch logs N`` reads them after a
#: ``%reload_ext`` too, as after ``%clorch stop``, until the next session starts
_kept_logs: dict[int, str] = {}


def load(ipython: Any) -> None:
    magics = ClorchMagics(ipython)
    magics.kept_logs = _kept_logs.pop(id(ipython), "")
    ipython.register_magics(magics)
    _registered[id(ipython)] = magics
    magics.head_start.install(getattr(ipython, "kernel", None))  # in a Jupyter kernel (ipykernel) only
    magics.prewarm()


def unload(ipython: Any) -> None:
    """Stop the ranks and take ``%clorch`` and ``%%distributed`` away again, so that a later load
    starts clean and no stale object can start ranks that nothing would stop."""
    magics = _registered.pop(id(ipython), None)
    if magics is None:
        return
    magics.head_start.uninstall()
    said = magics.shutdown(say=lambda text: print(f"clorch: {text}", flush=True))
    if said:  # %reload_ext too: a habit that must not end the ranks unsaid
        print(f"clorch: the extension was unloaded: {said}")
    atexit.unregister(magics.shutdown)
    if magics.kept_logs:
        _kept_logs[id(ipython)] = magics.kept_logs
    registry = ipython.magics_manager.magics
    for kind, names in magics.magics.items():
        for name in names:
            registry[kind].pop(name, None)


def magics_for(ipython: Any) -> ClorchMagics | None:
    """The loaded magics of a shell (tests and tools reach the session through it)."""
    return _registered.get(id(ipython))


__all__ = ["ClorchMagics", "load", "unload", "magics_for"]
