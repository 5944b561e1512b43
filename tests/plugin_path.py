"""tests/plugins on sys.path, or off it: a launcher from outside the package (its dist-info's entry
point in the group clorch_repl.launchers) becomes visible to importlib.metadata, as an installed
plugin would be. Shared by the launcher suite (tests/integration/test_launchers.py) and the
registry's unit tests (tests/unit/test_launchers_units.py)."""

from __future__ import annotations

import os
import sys

PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")


def with_plugins() -> None:
    """Put tests/plugins on sys.path (taken off again by the fixture or test that put it there)."""
    if PLUGINS not in sys.path:
        sys.path.insert(0, PLUGINS)


def without_plugins() -> None:
    while PLUGINS in sys.path:
        sys.path.remove(PLUGINS)
