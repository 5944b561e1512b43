"""Checkpoints in one process: round trip, refusal of bad files, no pickled code. With ranks and
SIGKILL: tests/integration/test_checkpoint_live.py."""

from __future__ import annotations

import os
import random

import pytest
import torch

from clorch_repl import amp, data
from clorch_repl.distributed import load_checkpoint, save_checkpoint
from clorch_repl.errors import CheckpointError, ClorchError
from clorch_repl.training.checkpoint import read_checkpoint_metadata
from tests import train_helpers


def trained(seed: int = 0, width: int = 6):
    model = train_helpers.small_model(seed, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = train_helpers.batch(8)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return model, opt


def snapshot(model, opt=None):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return weights, (repr(opt.state_dict()) if opt is not None else None)


def unchanged(model, snap, opt=None) -> bool:
    weights, opt_repr = snap
    same = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    return same and (opt is None or repr(opt.state_dict()) == opt_repr)


def test_round_trip_single_process(tmp_path) -> None:
    model, opt = trained()
    sampler = data.distributed_sampler(40, num_replicas=1, rank=0)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    scaler = amp.grad_scaler(initial_scale=256.0, device="cpu")
    path = tmp_path / "sub" / "ckpt.pt"  # the folder is created
    assert save_checkpoint(path, model=model, optimizer=opt, sampler=sampler, scaler=scaler,
                           state={"epoch": 2, "global_step": 10, "loss": [0.5, 0.25]}) == str(path)
    after_save = (torch.rand(3), random.random())
    fresh, fresh_opt = trained(seed=4)
    fresh_sampler = data.distributed_sampler(40, num_replicas=1, rank=0)
    fresh_scaler = amp.grad_scaler(device="cpu")
    state = load_checkpoint(path, model=fresh, optimizer=fresh_opt, sampler=fresh_sampler, scaler=fresh_scaler)
    assert state == {"epoch": 2, "global_step": 10, "loss": [0.5, 0.25]}
    assert torch.equal(torch.rand(3), after_save[0]) and random.random() == after_save[1]
    assert unchanged(fresh, snapshot(model))
    assert repr(fresh_opt.state_dict()) == repr(opt.state_dict())
    assert fresh_sampler.position == 5 and fresh_scaler.get_scale() == 256.0
    meta = read_checkpoint_metadata(path)
    assert meta["state"]["epoch"] == 2 and meta["contents"] == ["model", "optimizer", "sampler", "scaler"]
    assert [n for n in os.listdir(path.parent)] == ["ckpt.pt"]  # no temporary files left


def test_file_mode_follows_the_umask(tmp_path) -> None:
    model, _ = trained()
    old = os.umask(0o027)
    try:
        save_checkpoint(tmp_path / "a.pt", model=model)
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "a.pt").st_mode & 0o777) == oct(0o640)
    save_checkpoint(tmp_path / "b.pt", model=model)
    assert os.stat(tmp_path / "b.pt").st_mode & 0o777 == 0o666 & ~old


def test_state_must_be_json(tmp_path) -> None:
    model, _ = trained()
    with pytest.raises(ClorchError, match="JSON-serialisable"):
        save_checkpoint(tmp_path / "a.pt", model=model, state={"t": torch.ones(1)})
    assert not os.listdir(tmp_path)


def _bad_files(tmp_path, good):
    raw = good.read_bytes()
    cases = {}
    cases["missing"] = (tmp_path / "nope.pt", "no checkpoint at")
    p = tmp_path / "truncated.pt"
    p.write_bytes(raw[: len(raw) // 2])
    cases["truncated"] = (p, "truncated")
    p = tmp_path / "flipped.pt"
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0xFF  # inside the weights (they dominate the file)
    p.write_bytes(bytes(flipped))
    cases["corrupt"] = (p, "corrupt")
    p = tmp_path / "empty.pt"
    p.write_bytes(b"")
    cases["empty"] = (p, "truncated")
    p = tmp_path / "plain.pt"
    torch.save({"weight": torch.ones(2)}, p)
    cases["plain torch file"] = (p, "not a clorch_repl checkpoint")
    return cases


def test_bad_checkpoints_raise_and_change_nothing(tmp_path) -> None:
    big = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    good = tmp_path / "good.pt"
    save_checkpoint(good, model=big, optimizer=torch.optim.SGD(big.parameters(), lr=0.1))
    for name, (path, match) in _bad_files(tmp_path, good).items():
        target = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        opt = torch.optim.SGD(target.parameters(), lr=0.1)
        snap = snapshot(target, opt)
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(path, model=target, optimizer=opt)
        assert unchanged(target, snap, opt), name


def test_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    model, opt = trained(width=6)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    other, other_opt = trained(seed=3, width=5)
    snap = snapshot(other, other_opt)
    with pytest.raises(CheckpointError, match=r"from another model: different shapes \(0.weight: saved \[6, 8\]"):
        load_checkpoint(tmp_path / "c.pt", model=other, optimizer=other_opt)
    assert unchanged(other, snap, other_opt)
    renamed = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1), torch.nn.Tanh())
    renamed.add_module("extra", torch.nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match="missing extra.weight"):
        load_checkpoint(tmp_path / "c.pt", model=renamed)
    # the model fits but the optimizer does not: the model must not be changed either
    same, _ = trained(seed=5)
    snap = snapshot(same)
    sgd = torch.optim.SGD(same.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="holds AdamW state but the optimizer is SGD"):
        load_checkpoint(tmp_path / "c.pt", model=same, optimizer=sgd)
    assert unchanged(same, snap)
    with pytest.raises(CheckpointError, match="no grad scaler state"):
        load_checkpoint(tmp_path / "c.pt", model=same, scaler=amp.grad_scaler(device="cpu"))
    assert unchanged(same, snap)


class _Evil:
    marker = ""

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_loading_runs_no_pickled_code(tmp_path) -> None:
    evil = _Evil()
    evil.marker = str(tmp_path / "pwned")
    path = tmp_path / "evil.pt"
    torch.save({"format": "clorch-checkpoint", "version": 1, "metadata": "{}", "model": None, "x": evil}, path)
    model, _ = trained()
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(path, model=model)
    assert not os.path.exists(evil.marker)
    assert unchanged(model, snap)
