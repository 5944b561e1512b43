"""Every module of the package imports on its own, first, in a fresh interpreter: an import cycle
(module A needing B half-initialised) fails here whichever module a user imports first."""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import importlib, pkgutil, sys, traceback
import clorch_repl
names = sorted(m.name for m in pkgutil.walk_packages(clorch_repl.__path__, "clorch_repl."))
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "clorch_repl" or m.startswith("clorch_repl.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=3))
print(len(names), "modules")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone_first() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[0]) > 60  # it really walked the package
