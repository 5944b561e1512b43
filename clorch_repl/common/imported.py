"""Whether a module's import has finished, for code that looks at a module without importing it.

A rank's control thread answers the notebook's probes (clorch_repl.diagnosis.probe) while its
main thread may be importing torch: a start's join imports it in fresh interpreters, and an
interrupt of that start asks every rank where it is. ``sys.modules`` holds a package from the
moment its import begins, so "torch" in ``sys.modules`` is no sign that ``torch/__init__`` has
set up its C extension; calling into that extension before then can crash the process. A CI run
saw a rank die of SIGSEGV in exactly that interrupt. Python marks a module whose import is still
running (``module.__spec__._initializing``, what its "partially initialized module" error reads).
"""

from __future__ import annotations

import sys
from types import ModuleType


def imported(name: str) -> ModuleType | None:
    """``sys.modules[name]`` once its import has finished; None while it was never imported or
    another thread (or this one, further up its stack) is still importing it."""
    module = sys.modules.get(name)
    if module is None:
        return None
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module
