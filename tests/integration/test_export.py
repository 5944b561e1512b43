"""``clorch-notebook export``, end to end: a notebook with markdown, notebook-only and
``%%distributed`` cells runs in a real notebook kernel on 2 gloo ranks (``clorch-notebook run``),
is exported, and the script runs under real torchrun (``python -m torch.distributed.run
--nproc-per-node 2``): each rank prints what that rank printed in the notebook."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from typing import Any

import nbformat

from rank_text import lines_of

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CELLS: list[tuple[str, str]] = [
    ("markdown", "# Averaging gradients by hand\nTwo ranks fit one line together."),
    ("code", "%load_ext clorch_repl\n%clorch start --nproc 2 --backend gloo"),
    ("code", "steps = 5  # the notebook's own variable: the ranks never see it\nprint('notebook only', steps)"),
    ("code", "%%distributed\nimport torch, torch.distributed as dist\n"
             "print(f'rank {rank} of {world_size} on {device}')\n"
             "t = torch.arange(3.0) + rank\ndist.all_reduce(t)\nprint('sum', t.tolist())"),
    ("markdown", "Each rank takes its own half of the data."),
    ("code", "%%distributed\ntorch.manual_seed(0)\nx = torch.randn(64, 4)\ny = x @ torch.tensor([1.0, -2.0, 3.0, 0.5])\n"
             "mine = slice(rank * 32, (rank + 1) * 32)\nw = torch.zeros(4, requires_grad=True)\n"
             "def step(lr=0.1):\n    loss = ((x[mine] @ w - y[mine]) ** 2).mean()\n    loss.backward()\n"
             "    dist.all_reduce(w.grad)\n    w.grad /= world_size\n    with torch.no_grad():\n"
             "        w.sub_(lr * w.grad)\n    w.grad.zero_()\n    return loss.item()\n"
             "for i in range(3):\n    print(f'step {i} loss {step():.6f}')"),
    ("code", "%%distributed --ranks 0\ndoc = '''rank 0 reports\nin two lines'''\nprint(doc)\n"
             "print('weights', [round(v, 6) for v in w.tolist()])"),
    ("code", "%%distributed --gather final\nfinal = round(w.sum().item(), 6)\nprint('final', final)"),
    ("code", "print(final)\n%clorch stop"),
]


def _notebook(path: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
                for kind, src in CELLS]
    nbformat.write(nb, path)


def _env() -> dict[str, str]:
    """Without the repository on PYTHONPATH: the runner, the export and its script need only the
    installed package (the script not even that)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != ROOT)
    env.pop("CLORCH_NPROC", None)
    return env


def _stdout_of(cell: Any) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def test_an_exported_notebook_runs_under_torchrun_with_the_notebooks_output(tmp_path: Any) -> None:
    nb_path = str(tmp_path / "train.ipynb")
    _notebook(nb_path)
    executed = str(tmp_path / "train.executed.ipynb")
    done = subprocess.run([os.path.join(BIN, "clorch-notebook"), "run", nb_path, "--output", executed,
                           "--timeout", "300"], capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    ran = nbformat.read(executed, as_version=4)
    distributed = "".join(_stdout_of(c) for c in ran.cells
                          if c.cell_type == "code" and c.source.startswith("%%distributed"))
    in_notebook = {r: lines_of(distributed, r) for r in (0, 1)}
    assert in_notebook[0][:2] == ["rank 0 of 2 on cpu", "sum [1.0, 3.0, 5.0]"], distributed
    assert "rank 0 reports" in in_notebook[0] and "rank 0 reports" not in in_notebook[1]

    script = str(tmp_path / "train.py")
    export = subprocess.run([os.path.join(BIN, "clorch-notebook"), "export", nb_path, "-o", script],
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert export.returncode == 0, export.stdout + export.stderr
    assert f"wrote {script} (4 %%distributed cell(s), 1 warning(s))" in export.stdout, export.stdout
    assert "run it with: torchrun --nproc-per-node 2" in export.stdout
    assert export.stderr.strip() == ("clorch-notebook export: warning: cell 7 (%%distributed): --gather final gave "
                                     "the notebook each rank's last value; the script has no notebook, and "
                                     "gathers nothing"), export.stderr
    with open(script) as fh:
        text = fh.read()
    assert text.count("\n# %% ") >= 8 and "# print('notebook only', steps)" in text and "# %clorch stop" in text

    logs = tmp_path / "torchrun-logs"
    t0 = time.monotonic()
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--redirects", "1", "--log-dir", str(logs), script],
                              capture_output=True, text=True, env=_env(), cwd=str(tmp_path), timeout=300)
    took = time.monotonic() - t0
    assert torchrun.returncode == 0, torchrun.stdout[-4000:] + torchrun.stderr[-4000:]
    for r in (0, 1):
        found = glob.glob(str(logs / "**" / str(r) / "stdout.log"), recursive=True)
        assert len(found) == 1, (found, torchrun.stderr[-2000:])
        with open(found[0]) as fh:
            under_torchrun = fh.read().splitlines()
        assert under_torchrun == in_notebook[r], f"rank {r}:\n{under_torchrun}\nvs the notebook's\n{in_notebook[r]}"
    print(f"TIMING the exported script under torchrun, 2 gloo ranks: {took:.2f} s")
