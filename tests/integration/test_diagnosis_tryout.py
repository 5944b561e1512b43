"""The try-out's three defects of the hang and death diagnosis, on real 2-rank gloo sessions in a
real notebook kernel; what the user reads is asserted. The rules themselves, on recorded entries:
tests/unit/test_diagnosis_tryout_units.py.
"""

from __future__ import annotations

import re

import pytest

from notebook_kernel import clorch_session

pytestmark = pytest.mark.slow


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _flat(text: str) -> str:
    """What the user reads, on one line: clorch wraps its reports at a cell's width."""
    return " ".join(_plain(text).split())


def _no_empty_heading(text: str) -> None:
    """Every heading of a rank's evidence (``  last collectives:``) has lines under it."""
    lines = _plain(text).splitlines()
    for heading, following in zip(lines, lines[1:] + [""]):
        if heading.startswith("  ") and not heading.startswith("   ") and heading.endswith(":"):
            assert following.startswith("    "), f"empty heading {heading!r} in:\n{text}"


def test_a_scatter_is_no_mismatch_and_a_later_hang_says_nothing_of_it() -> None:
    with clorch_session() as nb:
        cell = nb.run("%%distributed\nimport torch, torch.distributed as dist\nt = torch.zeros(2)\n"
                      "dist.scatter(t, [torch.ones(2), 2 * torch.ones(2)] if rank == 0 else None, src=0)\n"
                      "got = [None]\ndist.scatter_object_list(got, [{'a': 1}, {'b': 'xx'}] if rank == 0 else None, src=0)\n"
                      "print(t.tolist(), got[0])\n")
        assert cell.status == "ok" and "[2.0, 2.0] {'b': 'xx'}" in cell.text, cell.text
        why = _flat(nb.run("%clorch why").text)
        assert why.startswith("no collective is pending: ranks 0-1 are not running a cell"), why
        assert "passed" not in why, why  # before: "scatter #2 ...: rank 0 passed float32[2, 2], rank 1 passed no tensor"
        hang = nb.run("%%distributed --timeout 4\nimport torch.distributed as dist\nif rank == 0: dist.barrier()\n",
                      timeout=90)
        text = _flat(hang.text)
        assert hang.status == "error" and "Why: barrier #" in text, text
        assert "rank 1 never called it and is not running a cell" in text and "earlier" not in text, text


def test_a_rank_that_raised_is_named_first_with_its_error() -> None:
    with clorch_session() as nb:
        failed = nb.run('%%distributed\nimport torch.distributed as dist\n'
                        'if rank == 1: raise RuntimeError("data file missing on rank 1")\ndist.barrier()\n', timeout=90)
        text = _flat(failed.text)
        assert failed.status == "error", text
        # the first line says why; the evidence and rank 1's traceback follow, as before
        assert text.startswith("Why: barrier #2 (default group): rank 0 waits in it; rank 1 raised RuntimeError "
                               "(data file missing on rank 1) before calling it ---- rank 0 ----"), text
        assert "RuntimeError: data file missing on rank 1" in text and "never called it" not in text, text


def test_a_survivors_fsdp2_wait_after_a_partial_restart_shows_its_evidence() -> None:
    with clorch_session() as nb:
        built = nb.run("%%distributed\nimport torch\nfrom torch.distributed.fsdp import fully_shard\n"
                       "from torch.distributed.device_mesh import init_device_mesh\n"
                       "model = fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh('cpu', (world_size,)))\n"
                       "print('built', flush=True)\n", timeout=120)
        assert built.status == "ok" and "built" in built.text, built.text
        nb.run("%%distributed --ranks 1\nimport os\nos.kill(os.getpid(), 9)\n", timeout=90)
        restarted = nb.run("%clorch restart --ranks 1", timeout=120)
        assert restarted.status == "ok", restarted.text
        hang = nb.run("%%distributed\nw = model.weight.full_tensor()\n", timeout=120)
        plain = _plain(hang.text)
        assert hang.status == "error" and "NameError" in plain, plain
        assert "rank 1 raised NameError (name 'model' is not defined) before calling it" in _flat(plain), plain
        rank0 = plain.split("---- rank 0 ----", 1)[1].split("---- rank 1 ----", 1)[0]
        assert re.search(r"\n {4}all_gather #\d+ \(float32\[4, 8\]\) group 0: scheduled\n", rank0), rank0
        assert "full_tensor()" in rank0 or "Cell In[" in rank0, rank0  # its stack, not a bare heading
        _no_empty_heading(plain)
