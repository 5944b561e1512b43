"""Every module of the package that a docstring or comment names by its path (``session/relay.py``)
exists: a module moved to another room (``held_notice.py`` from ``session/`` to ``notebook/``, issue
33) must not leave its readers pointed at where it was."""

from __future__ import annotations

import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "clorch_repl"


def test_every_module_path_named_in_the_package_exists() -> None:
    rooms = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    named = re.compile(r"(?<![\w/.])((?:%s)/\w+\.py)\b" % "|".join(rooms))
    missing = [f"{path.relative_to(PACKAGE)} names {match.group(1)}"
               for path in sorted(PACKAGE.rglob("*.py")) for match in named.finditer(path.read_text())
               if not (PACKAGE / match.group(1)).exists()]
    assert missing == []
