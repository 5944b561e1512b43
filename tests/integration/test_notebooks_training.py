"""nbclient executes notebooks/distributed_training.ipynb in a real notebook kernel started where a
user's would be: in notebooks/ (as JupyterLab starts it), in the repository's root, and on a copy
elsewhere. The repository is taken off PYTHONPATH, so the notebook finds what it imports through
the installed package alone."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient
from notebook_kernel import cell_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(ROOT, "notebooks", "distributed_training.ipynb")


def both_ranks(joined: str, pattern: str) -> list[tuple[str, ...]]:
    """The groups of ``pattern`` on the lines that show it for ranks 0 and 1: one merged line
    (``[ranks 0-1]``) or one line per rank, in either order; fails when a rank's is missing or
    shown twice."""
    found = re.findall(rf"^\[(rank [01]|ranks 0-1)\] {pattern}$", joined, re.MULTILINE)
    labels = sorted(f if isinstance(f, str) else f[0] for f in found)
    assert labels in (["rank 0", "rank 1"], ["ranks 0-1"]), (pattern, labels, joined[-3000:])
    return [tuple(f[1:]) if isinstance(f, tuple) else () for f in found]


def env_without_repository() -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.pop("CLORCH_NPROC", None)
    return env


@pytest.mark.parametrize("where", ["notebooks", "root", "copy"])
def test_training_notebook_trains_checkpoints_and_resumes(where: str, tmp_path) -> None:
    stale = os.path.join(tempfile.gettempdir(), "clorch-notebook-ddp.pt")
    fsdp = os.path.join(tempfile.gettempdir(), "clorch-notebook-fsdp")  # the sharded checkpoint's folder
    if os.path.exists(stale):
        os.unlink(stale)
    shutil.rmtree(fsdp, ignore_errors=True)
    path, cwd = NOTEBOOK, os.path.dirname(NOTEBOOK)
    if where == "root":
        cwd = ROOT
    elif where == "copy":
        path = shutil.copy(NOTEBOOK, tmp_path / "training.ipynb")
        cwd = str(tmp_path)
    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3").execute(cwd=cwd, env=env_without_repository())
    finally:
        if os.path.exists(stale):
            os.unlink(stale)  # the notebook's checkpoints: leave nothing behind in /tmp
        shutil.rmtree(fsdp, ignore_errors=True)
    joined = "\n".join(cell_text(c) for c in nb.cells if c.cell_type == "code")
    assert "error" not in [o.output_type for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    # No cell prints its rank: the session labels each line, and merges what every rank printed
    # alike. A copy later than the merge's hold (a loaded box) is shown on its own, under its own
    # label: never wrong, so either form counts, but every rank's line is there exactly once.
    both_ranks(joined, r"512 samples per epoch on cpu, bfloat16")  # 1024 samples over 2 ranks
    for epoch, steps in ((2, 16), (3, 24)):  # each rank's own loss
        assert both_ranks(joined, rf"epoch {epoch}, {steps} steps, mean loss [0-9.]+"), (epoch, joined[-3000:])
    saved = both_ranks(joined, r"weights ([0-9a-f]{16})")
    resumed = both_ranks(joined, r"resumed at epoch 2, step 16, weights ([0-9a-f]{16})")
    assert len({w for (w,) in saved}) == 1, saved  # the replicas were identical
    assert {w for (w,) in resumed} == {w for (w,) in saved}, (saved, resumed)  # the restarted ranks got them
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert len(sources) == len(set(sources))  # no cell repeats another
    assert not any(re.search(r"print\(f?[\"']rank \{?rank", s) for s in sources)
    assert re.search(r"\[ranks 0-1\] fsdp: 8 steps, saved \['\.metadata', '__0_0\.distcp', '__1_0\.distcp', "
                     r"'clorch\.pt'\]; resumed at step 8, 16 steps, weights [0-9a-f]{16}", joined), joined[-2000:]
    assert "stopped 2 rank(s)" in joined
