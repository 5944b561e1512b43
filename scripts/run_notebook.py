"""Execute a notebook headless in a real kernel and print what each cell showed.

    python scripts/run_notebook.py notebooks/quickstart.ipynb [--out executed.ipynb] [--timeout S]

Cells tagged ``raises-exception`` may fail (the quickstart shows an error on purpose); any other
failure stops the run with a non-zero exit. The executed notebook is written beside the original
as ``*.executed.ipynb`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def show(nb: nbformat.NotebookNode) -> None:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        print(f"\n=== In [{index}] " + cell.source.splitlines()[0] if cell.source else "")
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                print(out.text, end="")
            elif out.output_type in ("display_data", "execute_result"):
                print(out.data.get("text/plain", "<rich output>"))
            elif out.output_type == "error":
                print(ANSI.sub("", "\n".join(out.traceback)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook")
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=600, help="per-cell limit in seconds")
    args = parser.parse_args(argv)
    nb = nbformat.read(args.notebook, as_version=4)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": root}})
    t0 = time.monotonic()
    status = 0
    try:
        client.execute()
    except CellExecutionError as exc:
        print(f"a cell failed:\n{ANSI.sub('', str(exc))}", file=sys.stderr)
        status = 1
    show(nb)
    out = args.out or re.sub(r"\.ipynb$", ".executed.ipynb", args.notebook)
    nbformat.write(nb, out)
    print(f"\n{'FAILED' if status else 'OK'}: {args.notebook} ran in {time.monotonic() - t0:.1f} s; "
          f"executed copy: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
