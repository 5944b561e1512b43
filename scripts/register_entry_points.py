"""Register clorch_repl's entry points for a checkout that is on PYTHONPATH but not pip-installed.

    python3 scripts/register_entry_points.py TARGET_DIR    (TARGET_DIR on sys.path, e.g. /tmp/site)

The GPU machine has no build tools' network and runs the checkout from ``PYTHONPATH``; without
its entry points jupyter_client cannot find the forked ranks' provisioner
(``clorch-forked-rank``), and every start falls back to fresh interpreters, so the GPU check
would never exercise the default. This writes the metadata ``importlib.metadata`` reads: a
``clorch_repl-VERSION.dist-info`` with ``METADATA`` and ``entry_points.txt`` taken from
``pyproject.toml``, the one place the entry points are declared. Nothing else is installed: the
code still comes from the checkout.
"""

from __future__ import annotations

import os
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(target: str) -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    version = project.get("version", "0")
    info = os.path.join(target, f"{project['name']}-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {version}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        for group, entries in project.get("entry-points", {}).items():
            fh.write(f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n")
    return info


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(f"entry points registered in {main(sys.argv[1])}")
