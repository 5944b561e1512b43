"""Kept for old command lines; the runner ships with the package as ``clorch-notebook run``.

    python scripts/run_notebook.py NB.ipynb [--out OUT.ipynb] [--timeout S] [--nproc N]

is ``clorch-notebook run NB.ipynb [--output OUT.ipynb] ...`` (see clorch_repl/tools/notebook_runner.py).
"""

from __future__ import annotations

import sys

from clorch_repl.tools.notebook_cli import main

if __name__ == "__main__":
    args = ["--output" if a == "--out" else a for a in sys.argv[1:]]
    sys.exit(main(["run", *args]))
