"""The parts of the sharded checkpoint that decide, without any process: the metadata allow-list,
the commit's swap and its refusals, the file check, host staging, the ranks' merged verdicts and
the status line."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from clorch_repl.errors import CheckpointError, ConfigError
from clorch_repl.magics.views import saves_line
from clorch_repl.training.checkpoint import commit, safe_dcp
from clorch_repl.training.checkpoint.ranks import raise_if_any
from clorch_repl.training.checkpoint.staging import Stager


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_the_metadata_unpickler_resolves_dcp_classes_and_refuses_others(tmp_path) -> None:
    import pathlib

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata, _MEM_FORMAT_ENCODING)

    index = MetadataIndex("model.w", torch.Size([0, 0]), 0)
    md = Metadata(state_dict_metadata={"model.w": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16, memory_format=torch.channels_last), size=torch.Size([4, 2]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 2]))]),
        "optimizer.lr": BytesStorageMetadata()},
        storage_data={index: _StorageInfo(pathlib.PosixPath("__0_0.distcp"), 0, 16)},
        storage_meta=StorageMeta(checkpoint_id=pathlib.PosixPath("/ckpt"), save_id="s"))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    back = safe_dcp.read_metadata(str(tmp_path))
    assert back == md  # the dataclasses' own equality, field by field
    entry = back.state_dict_metadata["model.w"]
    assert entry.properties.memory_format is torch.channels_last and entry.properties.dtype is torch.bfloat16
    # the real classes, not the reader's stand-ins (a dataclass without fields gets no BUILD; a frozen one)
    assert (type(back), type(entry), type(entry.properties), type(entry.chunks[0])) == (
        Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata)
    assert type(back.state_dict_metadata["optimizer.lr"]) is BytesStorageMetadata
    assert [type(k) for k in back.storage_data] == [MetadataIndex] and back.storage_data[index].offset == 0
    assert type(back.storage_meta) is StorageMeta and back.storage_meta.checkpoint_id == pathlib.PosixPath("/ckpt")
    for payload, name in ((_Evil(), "system"), ({"x": pickle.loads}, "loads"), (torch.nn.Linear(1, 1), "Linear")):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(payload))
        with pytest.raises(CheckpointError, match=rf"refused to load .*\.metadata: it names the Python object .*{name}"):
            safe_dcp.read_metadata(str(tmp_path))

    # pickle's BUILD on an allowed class itself would set its attributes for the whole process
    (tmp_path / ".metadata").write_bytes(b"cpathlib\nPurePosixPath\n}S'hacked'\nI1\nsb.")
    with pytest.raises(CheckpointError, match="sets attributes of PurePosixPath itself"):
        safe_dcp.read_metadata(str(tmp_path))
    assert not hasattr(pathlib.PurePosixPath, "hacked")
    # ... and on an object the whole process shares: an enum member, which calling the enum returns
    (tmp_path / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
                                         b"(I1\ntR}S'_value_'\nI99\nsb.")
    with pytest.raises(CheckpointError, match="sets attributes of a shared _MEM_FORMAT_ENCODING"):
        safe_dcp.read_metadata(str(tmp_path))
    assert [m.value for m in _MEM_FORMAT_ENCODING] == [0, 1, 2], "the process's enum was changed"
    # an enum member anywhere but a field of DCP's classes (where it would stay the reader's stand-in)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={
        "x": [_MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST]})))
    with pytest.raises(CheckpointError, match="outside the fields of DCP's metadata classes"):
        safe_dcp.read_metadata(str(tmp_path))
    # a class as a value (DCP sets storage_meta.load_id on what it finds there), and a value made real in
    # one dataclass and handed through pickle's memo to a place it would stay the reader's stand-in
    # (both found by the independent review)
    for crafted in (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}X\x13\x00\x00\x00state_dict_"
                    b"metadata}sX\x0c\x00\x00\x00storage_metactorch.distributed.checkpoint.metadata\nStorageMeta\nsb.",
                    b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}(X\x13\x00\x00\x00state_dict_"
                    b"metadata}(X\x01\x00\x00\x00tctorch.distributed.checkpoint.metadata\nTensorStorageMetadata\n)\x81}"
                    b"X\n\x00\x00\x00propertiesctorch.distributed.checkpoint.metadata\nTensorProperties\n)\x81(ctorch\n"
                    b"float32\nctorch.serialization\n_get_layout\nX\r\x00\x00\x00torch.strided\x85R\x89ctorch.distributed."
                    b"checkpoint.metadata\n_MEM_FORMAT_ENCODING\nJ\x01\x00\x00\x00\x85Rr2\x00\x00\x00\x89tbsbuX\x0c\x00"
                    b"\x00\x00planner_data]j2\x00\x00\x00aub."):
        (tmp_path / ".metadata").write_bytes(crafted)
        with pytest.raises(CheckpointError, match="refused to load .* where DCP's metadata never has one"):
            safe_dcp.read_metadata(str(tmp_path))
    assert StorageMeta.load_id is None  # the dataclass default, untouched
    # a length that would allocate 2**62 bytes: a bad file, not a MemoryError
    (tmp_path / ".metadata").write_bytes(b"\x80\x04\x8e" + (2 ** 62).to_bytes(8, "little") + b".")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        safe_dcp.read_metadata(str(tmp_path))
    # an unknown layout name, an encoding TensorProperties refuses: corrupt, not a bare KeyError
    bad = pickle.dumps(md).replace(b"torch.strided", b"torch.sparse_x")
    (tmp_path / ".metadata").write_bytes(bad)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        safe_dcp.read_metadata(str(tmp_path))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md)[:20])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        safe_dcp.read_metadata(str(tmp_path))
    os.unlink(tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match="not a finished sharded checkpoint"):
        safe_dcp.read_metadata(str(tmp_path))


def _folder(path, marker: str) -> None:
    os.makedirs(path)
    with open(os.path.join(path, ".metadata"), "w") as fh:
        fh.write(marker)


def test_commit_swaps_a_folder_in_and_leaves_nothing(tmp_path) -> None:
    target = str(tmp_path / "ckpt")
    first = commit.temp_folder(target)
    _folder(os.path.join(first, "x"), "")  # any content
    commit.commit(first, target)
    assert os.listdir(tmp_path) == ["ckpt"]
    second = commit.temp_folder(target)
    with open(os.path.join(second, ".metadata"), "w") as fh:
        fh.write("new")
    commit.commit(second, target)
    commit._finish_deleting()
    assert os.listdir(tmp_path) == ["ckpt"]
    with open(os.path.join(target, ".metadata")) as fh:
        assert fh.read() == "new"


def test_commit_without_an_atomic_swap_moves_aside_then_in(tmp_path, monkeypatch) -> None:
    # A filesystem without renameat2's RENAME_EXCHANGE cannot be made here: the swap is refused
    # by replacing it, which is what such a filesystem's EINVAL leads to.
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    target = str(tmp_path / "ckpt")
    _folder(target, "old")
    new = commit.temp_folder(target)
    with open(os.path.join(new, ".metadata"), "w") as fh:
        fh.write("new")
    commit.commit(new, target)
    commit._finish_deleting()
    assert os.listdir(tmp_path) == ["ckpt"]
    with open(os.path.join(target, ".metadata")) as fh:
        assert fh.read() == "new"


def test_leftovers_of_dead_writers_are_removed_and_a_cut_commit_is_named(tmp_path) -> None:
    target = str(tmp_path / "ckpt")
    host = commit._host()
    dead = tmp_path / f".ckpt.clorch-saving.{host}.999999999.abcd"
    other_host = tmp_path / ".ckpt.clorch-saving.elsewhere.1.abcd"
    alive = tmp_path / f".ckpt.clorch-saving.{host}.1.abcd"  # pid 1 runs
    for folder in (dead, other_host, alive):
        _folder(str(folder), "")
    assert commit.leftover_of(target) is not None  # target missing, a whole one beside it
    commit.remove_leftovers(target)
    assert sorted(os.listdir(tmp_path)) == sorted([other_host.name, alive.name])


def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path) -> None:
    commit.check_replaceable(str(tmp_path / "absent"), False)
    (tmp_path / "empty").mkdir()
    commit.check_replaceable(str(tmp_path / "empty"), False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.csv").write_text("x")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        commit.check_replaceable(str(tmp_path / "data"), False)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        commit.check_replaceable(str(tmp_path / "notes.txt"), False)
    os.symlink(tmp_path / "data", tmp_path / "link")
    with pytest.raises(ConfigError, match="symbolic link"):
        commit.check_replaceable(str(tmp_path / "link"), False)


def test_missing_and_truncated_shards_are_named(tmp_path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 10)
    (tmp_path / "__1_0.distcp").write_bytes(b"x" * 3)
    md = Metadata(state_dict_metadata={}, storage_data={
        MetadataIndex("a"): _StorageInfo("__0_0.distcp", 0, 10),
        MetadataIndex("b"): _StorageInfo("__1_0.distcp", 0, 8),
        MetadataIndex("c"): _StorageInfo("__2_0.distcp", 0, 8)})
    assert commit.missing_files(str(tmp_path), md) == ["__1_0.distcp (truncated)", "__2_0.distcp"]
    md.storage_data[MetadataIndex("d")] = _StorageInfo("../escape", 0, 1)
    with pytest.raises(CheckpointError, match="outside its folder"):
        commit.missing_files(str(tmp_path), md)


def test_staging_copies_and_reuses_its_buffers() -> None:
    stager = Stager()
    state = {"model": {"w": torch.ones(3), "b": torch.zeros(2)}, "optimizer": {"lr": 0.1, "betas": (0.9, 0.99)}}
    staged = stager.stage(state)
    state["model"]["w"].add_(5)  # training changes the weights after the call
    assert torch.equal(staged["model"]["w"], torch.ones(3))
    assert staged["optimizer"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    again = stager.stage(state)
    assert again["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()  # the same buffer, refilled
    assert torch.equal(again["model"]["w"], torch.full((3,), 6.0))
    bigger = stager.stage({"model": {"w": torch.ones(4)}})
    assert bigger["model"]["w"].shape == (4,)


def test_a_staged_dtensor_is_planned_once_for_its_buffers(monkeypatch) -> None:
    """DCP builds each DTensor's write item at every save, on the asynchronous save's thread; a
    staged one (the same object, buffer and spec at every save of its layout) builds it once."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import planner_helpers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    built: list[str] = []
    real = planner_helpers._create_write_items_for_dtensor
    monkeypatch.setattr(planner_helpers, "_create_write_items_for_dtensor",
                        lambda fqn, tensor: built.append(fqn) or real(fqn, tensor))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        weight = distribute_tensor(torch.arange(6.0).reshape(3, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
        stager = Stager()
        staged = stager.stage({"w": weight})["w"]
        first = planner_helpers._create_write_items("model.w", staged)  # what DCP's planning calls
        weight.add_(1)  # training goes on; the next save stages into the same buffers
        again = stager.stage({"w": weight})["w"]
        assert again is staged and torch.equal(again.to_local(), torch.arange(6.0).reshape(3, 2) + 1)
        assert planner_helpers._create_write_items("model.w", again) == first == [real("model.w", staged)]
        assert built == ["model.w"], "the write item was built again at the second save"
        # the cache keeps nothing alive: dropped by the Stager, the staged buffer goes at once
        import gc
        import weakref

        gone = weakref.ref(staged._local_tensor)  # the host buffer itself (to_local() may be a new alias)
        del staged, again
        gc.disable()  # only reference counting may free it: a cycle would wait for the collector
        try:
            stager.release()
            assert gone() is None, "the staged buffer outlived the Stager's release (a reference cycle)"
        finally:
            gc.enable()
    finally:
        dist.destroy_process_group()


def test_ranks_verdicts_merge_one_cause_and_list_several() -> None:
    with pytest.raises(CheckpointError, match=r"^saving failed on ranks 0-1: disk full; nothing was changed"):
        raise_if_any(["disk full", "disk full"], "saving")
    with pytest.raises(CheckpointError, match=r"^loading failed on ranks 0,2 \(rank 0: a; rank 2: b\); the ranks may "):
        raise_if_any(["a", None, "b"], "loading", changed=True)
    with pytest.raises(CheckpointError, match=r"^alone$"):
        raise_if_any(["alone"], "saving")
    raise_if_any([None, None], "saving")


def test_the_status_line_of_saves_in_flight() -> None:
    assert saves_line({}) is None
    line = saves_line({0: [{"path": "/c/p", "for_s": 2.4}], 1: [{"path": "/c/p", "for_s": 3.6}]})
    assert line == ("checkpoint save in flight: /c/p (ranks 0-1, writing for 4 s); its handle's wait() returns "
                    "when it is committed")


def test_sharded_round_trip_in_one_process(tmp_path) -> None:
    """sharded=True for a plain model in a process without a group: the same parts come back."""
    import random

    from clorch_repl import amp, data
    from clorch_repl.distributed import load_checkpoint, save_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sampler = data.distributed_sampler(40, num_replicas=1, rank=0)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    scaler = amp.grad_scaler(initial_scale=128.0, device="cpu")
    path = str(tmp_path / "sharded")
    assert save_checkpoint(path, model=model, optimizer=opt, sampler=sampler, scaler=scaler, sharded=True,
                           state={"epoch": 2}) == path
    expected = (torch.rand(2), random.random())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sampler = data.distributed_sampler(40, num_replicas=1, rank=0)
    fresh_scaler = amp.grad_scaler(device="cpu")
    assert load_checkpoint(path, model=fresh, optimizer=fresh_opt, sampler=fresh_sampler,
                           scaler=fresh_scaler) == {"epoch": 2}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
    assert fresh_sampler.position == 5 and fresh_scaler.get_scale() == 128.0
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    with pytest.raises(ConfigError, match="sharded must be True, False or None"):
        save_checkpoint(path, model=model, sharded="yes")  # type: ignore[arg-type]
