"""The error module in a fresh interpreter: importing it imports no torch. The hierarchy itself:
tests/unit/test_errors.py."""

from __future__ import annotations

import subprocess
import sys


def test_errors_imports_no_torch() -> None:
    """Every process imports it (the notebook, the supervisor), so it stays a leaf."""
    code = ("import sys, clorch_repl.errors, clorch_repl.common.atomic; "
            "print(sorted(m for m in ('torch', 'IPython', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
