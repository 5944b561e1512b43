"""Values between the notebook and its ranks: %clorch pull/push and %%distributed --gather.

The format's rules are tested on their own (fast, no ranks: tests/unit/test_transfer_units.py); the
commands through a real notebook kernel driving two real gloo ranks, as JupyterLab drives one."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from notebook_kernel import NotebookKernel, clorch_session


# ---------------------------------------------------------------- through a notebook kernel
@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    with clorch_session() as kernel:
        yield kernel


def ok(nb: NotebookKernel, code: str) -> str:
    reply = nb.run(code)
    assert reply.status == "ok", reply.text
    return reply.text


def failed(nb: NotebookKernel, code: str) -> str:
    """The refusal's words on one line: clorch wraps its messages to the cell's width (issue 38)."""
    reply = nb.run(code)
    assert reply.status == "error", reply.text
    return " ".join(reply.text.split())


def no_value_files_left(nb: NotebookKernel) -> None:
    text = ok(nb, "from clorch_repl.magics import magics_for\nimport os\n"
                  "print('LEFT', [f for f in os.listdir(magics_for(get_ipython()).session.group.dir) "
                  "if f.startswith('value-')])")
    assert "LEFT []" in text


def test_pull_brings_each_ranks_tensors_and_dicts_to_the_notebook_on_cpu(nb: NotebookKernel) -> None:
    ok(nb, "%%distributed\nimport torch\nstate = {'loss': torch.tensor([1.0, 2.0]) * (rank + 1), 'step': 10 + rank}")
    ok(nb, "%clorch pull state")
    text = ok(nb, "print('GOT', sorted(state), state[1]['loss'].tolist(), state[0]['step'], state[1]['loss'].device, "
                  "type(state[1]['loss']).__name__)")
    assert "GOT [0, 1] [2.0, 4.0] 10 cpu Tensor" in text
    ok(nb, "%clorch pull state --ranks 1")
    assert "ONLY [1]" in ok(nb, "print('ONLY', sorted(state))")
    no_value_files_left(nb)


def test_push_sends_a_notebook_value_to_the_chosen_ranks(nb: NotebookKernel) -> None:
    ok(nb, "import torch\ncfg = {'lr': 0.5, 'w': torch.ones(3), 'name': 'run-7'}")
    ok(nb, "%clorch push cfg")
    text = ok(nb, "%%distributed\nprint(cfg['name'], float((cfg['w'] * cfg['lr']).sum()) + rank)")
    assert "[rank 0] run-7 1.5" in text and "[rank 1] run-7 2.5" in text
    ok(nb, "only_one = 3")
    ok(nb, "%clorch push only_one --ranks 1")
    text = ok(nb, "%%distributed\nprint('has it:', 'only_one' in dir())")
    assert "[rank 0] has it: False" in text and "[rank 1] has it: True" in text
    no_value_files_left(nb)


def test_gather_collects_the_cells_last_expression(nb: NotebookKernel) -> None:
    ok(nb, "%%distributed --gather out\nimport torch\ntorch.full((2,), float(rank))")
    text = ok(nb, "print('OUT', {r: v.tolist() for r, v in out.items()})")
    assert "OUT {0: [0.0, 0.0], 1: [1.0, 1.0]}" in text
    ok(nb, "%%distributed --gather same\n{'epochs': 3}")
    assert "SAME {0: {'epochs': 3}, 1: {'epochs': 3}}" in ok(nb, "print('SAME', same)")


def test_a_value_too_large_fails_clearly_and_the_notebook_stays_responsive(nb: NotebookKernel) -> None:
    ok(nb, "%%distributed\nimport torch\nbig = torch.zeros(2_000_000)")  # 8 MB
    t0 = time.monotonic()
    text = failed(nb, "%clorch pull big --max-mb 1")
    assert "ranks 0-1: TransferError: big is 8.0 MB, over the limit of 1.0 MB" in text
    assert "--max-mb" in text
    ok(nb, "import torch\nhuge = torch.zeros(3_000_000)")
    text = failed(nb, "%clorch push huge --max-mb 2")
    assert "huge is 12.0 MB, over the limit of 2.0 MB" in text
    assert "alive" in ok(nb, "print('alive')")  # the notebook answers at once
    assert time.monotonic() - t0 < 30
    ok(nb, "%clorch pull big --max-mb 10")  # raising the limit lets it through
    assert "8000000" in ok(nb, "print(big[0].numel() * 4)")
    no_value_files_left(nb)


def test_unsendable_values_fail_clearly_naming_rank_and_type(nb: NotebookKernel) -> None:
    ok(nb, "%%distributed\nf = (lambda x: x) if rank == 1 else 1.0")
    text = failed(nb, "%clorch pull f")
    assert "rank 1: TransferError: f is a function, which cannot be sent" in text
    assert "rank 0" not in text
    ok(nb, "import os")
    text = failed(nb, "%clorch push os")
    assert "os is a module, which cannot be sent" in text
    text = failed(nb, "%%distributed --gather g\nimport torch\ntorch.nn.Linear(1, 1)")
    assert "torch.nn.modules.linear.Linear, which cannot be sent" in text and "state_dict" in text
    text = failed(nb, "%clorch pull not_defined_anywhere")
    assert "ranks 0-1: NameError: name 'not_defined_anywhere' is not defined" in text
    text = failed(nb, "%clorch pull 1x")
    assert "NAME must be a Python variable name" in text
    assert "alive" in ok(nb, "print('alive')")
    no_value_files_left(nb)
