"""``python -m clorch_repl.release_check`` (also ``clorch-release-check``): the release check. It
lives in :mod:`clorch_repl.tools.release_check`; this name stays because it is the command users,
their scripts and the README have run."""

from __future__ import annotations

import sys

from .tools.release_check import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
