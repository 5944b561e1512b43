"""nbclient executes notebooks/quickstart.ipynb in a real notebook kernel started in notebooks/, as
JupyterLab and the README's main job (clorch-notebook) start it."""

from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient
from notebook_kernel import cell_text
from test_notebooks_training import env_without_repository

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_notebook_runs_end_to_end() -> None:
    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3").execute(cwd=os.path.join(ROOT, "notebooks"),
                                                                  env=env_without_repository())
    texts = [cell_text(c) for c in nb.cells if c.cell_type == "code"]
    joined = "\n".join(texts)
    assert "2 rank(s) ready, gloo process group formed" in joined
    assert "[ranks 0-1] sum over 2 ranks: [3.0, 3.0, 3.0]" in joined  # the same on both ranks: shown once
    assert "[ranks 0-1] 3" in joined  # bor of 1<<0 and 1<<1, the same on both ranks: shown once
    assert "[ranks 0-1] 9.0" in joined
    status = next(c for c in nb.cells if c.source.startswith("%clorch status"))
    assert "text/html" in status.outputs[0].data and "idle" in cell_text(status)
    logs = next(c for c in nb.cells if c.source.startswith("%clorch logs"))
    assert "sum over 2 ranks" in cell_text(logs)
    failing = next(c for c in nb.cells if "raises-exception" in c.metadata.get("tags", []))
    err = [o for o in failing.outputs if o.output_type == "error"]
    assert len(err) == 1 and "only rank 1 fails" in "\n".join(err[0].traceback)
    assert "[rank 0] fine" in cell_text(failing)
    assert "[ranks 0-1] False" in joined  # restart gave fresh namespaces
    assert "stopped 2 rank(s)" in joined
