"""The DDP wrapper without a group: it needs one, and no_sync and the optimizer step work on a
plain model. On a real 2-rank gloo group: tests/integration/test_parallel.py."""

from __future__ import annotations

import pytest
import torch


def test_wrapper_needs_a_process_group() -> None:
    from clorch_repl import parallel
    from clorch_repl.errors import ClorchError

    with pytest.raises(ClorchError, match="needs an initialised process group"):
        with parallel.distributed_data_parallel(torch.nn.Linear(2, 2)):
            pass


def test_no_sync_and_optimizer_step_work_on_a_plain_model() -> None:
    from clorch_repl import amp, parallel

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with parallel.no_sync(model):
        model(torch.ones(2, 3)).sum().backward()
    assert parallel.optimizer_step(model, opt) is True
    assert not torch.equal(before, model.weight)
    scaler = amp.grad_scaler(initial_scale=8.0, device="cpu")
    opt.zero_grad()
    amp.backward(scaler, model(torch.ones(2, 3)).sum())
    model.weight.grad.view(-1)[0] = float("nan")
    assert parallel.optimizer_step(model, opt, scaler=scaler) is False
    assert scaler.get_scale() == 4.0
