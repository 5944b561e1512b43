"""Shared fixtures: an IPython shell with clorch_repl loaded, and a running 2-rank gloo session.

The shell is IPython's real InteractiveShell, in this process; the ranks are real ipykernels in
real processes forming a real gloo group. Nothing of clorch_repl is mocked.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Ranks must be able to import the test helpers and the examples, as a notebook in ROOT could.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def ip() -> Iterator[Any]:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "clorch_repl")
    yield shell
    from clorch_repl.magics import magics_for

    magics = magics_for(shell)
    if magics is not None:
        magics.shutdown()


@pytest.fixture()
def magics(ip: Any) -> Any:
    from clorch_repl.magics import magics_for

    return magics_for(ip)


@pytest.fixture(scope="module")
def ranks(ip: Any) -> Iterator[Any]:
    """A started 2-rank gloo session for the tests of one module; stopped (and checked) after."""
    from clorch_repl.magics import magics_for
    from clorch_repl.procs import wait_gone

    magics = magics_for(ip)
    if magics.session is None or not magics.session.running:
        ip.run_line_magic("clorch", "start --nproc 2")
    yield magics
    pids = magics.session.pids() if magics.session else []
    magics.shutdown()
    assert wait_gone(pids, 10) == []
