"""The distributed sampler: partitions, shuffles, padding, resumption and its use in a DataLoader."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler as TorchSampler, TensorDataset

from clorch_repl import data
from clorch_repl.errors import ConfigError


def shares(n: int, replicas: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for rank in range(replicas):
        s = data.distributed_sampler(n, num_replicas=replicas, rank=rank, **kw)
        s.set_epoch(epoch)
        out.append(s.sample_indices())
    return out


@pytest.mark.parametrize("n,replicas", [(100, 2), (101, 2), (10, 3), (7, 4), (1024, 2)])
def test_partitions_disjoint_and_cover(n: int, replicas: int) -> None:
    parts = shares(n, replicas)
    assert len({len(p) for p in parts}) == 1  # every rank gets the same count (lockstep)
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(n))
    padding = len(flat) - n
    assert 0 <= padding < replicas
    if padding == 0:
        assert len(set(flat)) == len(flat)


@pytest.mark.parametrize("n,replicas", [(101, 2), (10, 3), (7, 4)])
def test_drop_last_is_disjoint_and_drops_the_tail(n: int, replicas: int) -> None:
    parts = shares(n, replicas, drop_last=True)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == (n // replicas) * replicas


def test_same_seed_and_epoch_repeat_other_epochs_and_seeds_differ() -> None:
    assert shares(64, 2, epoch=3) == shares(64, 2, epoch=3)
    assert shares(64, 2, epoch=3) != shares(64, 2, epoch=4)
    assert shares(64, 2, epoch=3, seed=1) != shares(64, 2, epoch=3, seed=2)
    assert shares(10, 2, shuffle=False) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_torch_distributed_sampler(drop_last: bool) -> None:
    dataset = list(range(37))
    for rank in range(3):
        ours = data.distributed_sampler(37, num_replicas=3, rank=rank, seed=5, drop_last=drop_last)
        theirs = TorchSampler(dataset, num_replicas=3, rank=rank, seed=5, drop_last=drop_last)
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_replicas_and_rank_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = data.distributed_sampler(40)
    assert (s.num_replicas, s.rank, len(s)) == (4, 3, 10)
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="RANK is not set"):
        data.distributed_sampler(40)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="RANK='x'"):
        data.distributed_sampler(40)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dataset_size=-1), "dataset_size"), (dict(dataset_size=2.5), "dataset_size"),
    (dict(num_replicas=0), "num_replicas"), (dict(rank=2), "out of range"), (dict(rank=-1), "rank"),
    (dict(seed="a"), "seed"), (dict(num_replicas=True), "num_replicas"),
])
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    base = dict(dataset_size=10, num_replicas=2, rank=0)
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        data.distributed_sampler(**base)


def test_a_dataset_is_taken_for_its_length_as_torchs_sampler_takes_it() -> None:
    """Code brought from torch passes the dataset (torch's DistributedSampler(dataset)); it was
    refused as "dataset_size must be a whole number; got <TensorDataset object at 0x...>"."""
    dataset = TensorDataset(torch.arange(50))
    ours = list(data.distributed_sampler(dataset, num_replicas=2, rank=1, seed=3))
    assert ours == list(data.distributed_sampler(50, num_replicas=2, rank=1, seed=3)) and len(ours) == 25


def test_usable_in_a_dataloader() -> None:
    dataset = TensorDataset(torch.arange(50))
    s = data.distributed_sampler(50, num_replicas=2, rank=1, seed=3)
    loader = DataLoader(dataset, batch_size=8, sampler=s)
    got = [int(v) for (b,) in loader for v in b]
    assert got == s.sample_indices() and len(loader) == 4


def test_resume_continues_with_the_next_batch() -> None:
    full = data.distributed_sampler(100, num_replicas=2, rank=0, seed=9)
    full.set_epoch(1)
    reference = list(BatchSampler(full, 8, drop_last=False))

    first = data.distributed_sampler(100, num_replicas=2, rank=0, seed=9)
    first.set_epoch(1)
    it = iter(BatchSampler(first, 8, drop_last=False))
    seen = [next(it) for _ in range(3)]  # three batches trained, then the run stops
    state = first.state_dict()
    assert state["position"] == 24 and state["epoch"] == 1
    assert {"epoch", "seed", "rank", "num_replicas", "shuffle", "drop_last", "position"} <= set(state)

    resumed = data.distributed_sampler(100, num_replicas=2, rank=0, seed=0)  # seed comes from the state
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the usual loop line: same epoch keeps the position
    rest = list(BatchSampler(resumed, 8, drop_last=False))
    assert seen + rest == reference
    resumed.set_epoch(2)  # the next epoch starts from its beginning
    assert resumed.position == 0 and len(list(resumed)) == 50


def test_dataloader_position_tracks_trained_batches() -> None:
    s = data.distributed_sampler(64, num_replicas=2, rank=0)
    loader = DataLoader(TensorDataset(torch.arange(64)), batch_size=4, sampler=s)
    for k, _batch in enumerate(loader):
        assert s.position == (k + 1) * 4
        if k == 2:
            break


def test_state_validation_refuses_other_splits() -> None:
    s = data.distributed_sampler(100, num_replicas=2, rank=0)
    state = s.state_dict()
    with pytest.raises(ConfigError, match="over 4"):
        data.distributed_sampler(100, num_replicas=4, rank=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="covered 100 samples"):
        data.distributed_sampler(99, num_replicas=2, rank=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="missing"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ConfigError, match="past the end"):
        s.load_state_dict(dict(state, position=51))
    with pytest.raises(ConfigError):
        s.position = 51


def test_warns_when_an_epoch_is_iterated_again_without_set_epoch() -> None:
    s = data.distributed_sampler(20, num_replicas=2, rank=0)
    s.set_epoch(0)
    first = list(s)
    with pytest.warns(data.SameEpochWarning, match="without set_epoch"):
        again = list(s)
    assert again == first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.set_epoch(1)
        list(s)
        s.set_epoch(1)  # set again after finishing: a deliberate replay, no warning
        list(s)
