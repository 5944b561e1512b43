"""Sharded checkpoints (FSDP2, tensor parallel, 2-D meshes) on real gloo ranks: exact round trips,
resharding on another number of ranks and into an unsharded model without a process group,
asynchronous saves, refusals, a rank dying mid-save, and metadata that must not run code.

The ranks are real processes started by ``dist.launch`` (``train_helpers.run_ranks``); the
loads "without a process group" run in this test process, as in a notebook's own kernel."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import time

import psutil
import pytest
import torch

from clorch_repl.distributed import load_checkpoint, save_checkpoint
from clorch_repl.errors import CheckpointError, ClorchError, ConfigError, RankFailure
from clorch_repl.training.checkpoint import read_checkpoint_metadata
from tests import sharded_helpers as sh
from tests import train_helpers


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _plain_digest(path: str, kind: str) -> str:
    model = sh.build(kind, 11)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_checkpoint(path, model=model, optimizer=opt)
    return sh.digest(model, opt)


@pytest.mark.parametrize("kind,nproc,reshard", [("fsdp", 2, (4, 1)), ("tp", 2, (1,)), ("2d", 4, (2,))])
def test_sharded_round_trip_is_exact_and_reshards(tmp_path, kind, nproc, reshard) -> None:
    path = str(tmp_path / f"{kind}-ckpt")
    saved = train_helpers.run_ranks("tests.sharded_helpers:save_then_load", nproc=nproc,
                                    args={"kind": kind, "path": path})
    assert len(saved) == nproc
    digests = {r["saved"] for r in saved}
    assert len(digests) == 1, "every rank digests the same full tensors"
    (expected,) = digests
    for r in saved:
        assert r["loaded"] == expected, r  # weights and optimizer state, bit for bit
        assert r["state"] == {"step": 1, "kind": kind}
    names = sorted(os.listdir(path))
    assert ".metadata" in names and "clorch.pt" in names
    assert sum(n.endswith(".distcp") for n in names) == nproc, names  # every rank wrote its own shards
    meta = read_checkpoint_metadata(path)
    assert meta["layout"] == "sharded" and meta["world_size"] == nproc
    for other in reshard:  # the same checkpoint on another number of ranks, sharded the same way
        other_kind = kind if not (kind == "2d" and other == 2) else "fsdp_mlp_free"
        if other_kind == "fsdp_mlp_free":
            other_kind = "tp"  # a 2-D checkpoint loaded into a 1-D tensor-parallel model
        if other == 1:
            loaded = [_plain_digest(path, "plain" if kind == "fsdp" else "tp_plain")]
        else:
            loaded = [r["loaded"] for r in train_helpers.run_ranks(
                "tests.sharded_helpers:load_only", nproc=other, args={"kind": other_kind, "path": path})]
        assert loaded == [expected] * other, (kind, other)


def test_torch_tools_read_the_folder(tmp_path) -> None:
    """The folder is torch.distributed.checkpoint's own format: dcp_to_torch_save converts it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = sh.build("plain", 2)
    path = str(tmp_path / "dcp")
    assert save_checkpoint(path, model=model, sharded=True) == path
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    full = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    assert set(full) == {"model"}
    assert all(torch.equal(full["model"][k], v) for k, v in model.state_dict().items())


def test_async_save_holds_the_state_at_the_call(tmp_path) -> None:
    path = str(tmp_path / "async")
    results = train_helpers.run_ranks("tests.sharded_helpers:save_then_load", nproc=2,
                                      args={"kind": "fsdp", "path": path, "async": True})
    for r in results:
        assert r["changed_meanwhile"], "the weights changed while the save wrote"
        assert r["waited"] == path
        assert r["loaded"] == r["saved"], "the checkpoint holds the state at the call"
        assert r["state_right_after"] == {"step": 2, "kind": "fsdp"} and r["right_after_exact"], r
        assert r["staged_s"] < 30


def test_async_failure_is_raised_by_wait_and_saves_queue(tmp_path) -> None:
    path = str(tmp_path / "queued")
    results = train_helpers.run_ranks("tests.sharded_helpers:failing_async_write", nproc=2, args={"path": path})
    assert len(results) == 2
    for r in results:
        assert r["error"] == ("CheckpointError: saving the checkpoint failed on ranks 0-1: writing the shards "
                              "failed (rank 1: OSError: [Errno 28] No space left on device (injected by the "
                              "test)); nothing was changed on any rank"), r["error"]
        assert r["done"]
        assert r["state_after_failure"] == {"version": 1} and r["previous_whole"]
        assert r["first_done_when_second_returned"]
        assert r["second"] == path + "-b"
        assert r["final_state"] == {"version": 3}
    assert sorted(os.listdir(tmp_path)) == ["queued", "queued-b"], "the failed save's folder was removed"


def test_models_that_do_not_fit_are_refused_naming_keys(tmp_path) -> None:
    path = str(tmp_path / "fit")
    train_helpers.run_ranks("tests.sharded_helpers:save_then_load", nproc=2, args={"kind": "fsdp", "path": path})
    results = train_helpers.run_ranks("tests.sharded_helpers:mismatches", nproc=2, args={"path": path})
    for r in results:
        assert "CheckpointError" in r["missing"] and "missing layers.2." in r["missing"], r["missing"]
        assert "different shapes (embed.weight: saved [32, 16], model [32, 32]" in r["shapes"], r["shapes"]
        assert "unexpected layers.1." in r["unexpected"], r["unexpected"]
        assert "holds AdamW state but the optimizer is SGD" in r["sgd"], r["sgd"]
        assert f"CheckpointError: no checkpoint at {path}-nowhere: check the path" in r["nowhere"], r["nowhere"]
        assert r["unchanged"]
    # the same refusal without a process group, in this process
    with pytest.raises(CheckpointError, match="missing layers.2"):
        load_checkpoint(path, model=sh.Transformer(layers=sh.LAYERS + 1))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async"])
def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_whole(tmp_path, asynchronous) -> None:
    path = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure):
        train_helpers.run_ranks("tests.sharded_helpers:dies_while_saving", nproc=2, timeout_s=120,
                                args={"path": path, "die_rank": 1, "async": asynchronous})
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert leftovers and all(".clorch-saving." in n for n in leftovers), leftovers  # the cut save's folder
    assert load_checkpoint(path, model=sh.build("plain", 1), restore_rng=False) == {"version": 1}
    # the next save clears what the dead one left
    save_checkpoint(path, model=sh.build("plain", 1), sharded=True, state={"version": 3})
    deadline = time.monotonic() + 10  # the replaced checkpoint is deleted on a thread
    while os.listdir(tmp_path) != ["ckpt"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert read_checkpoint_metadata(path)["state"] == {"version": 3}


def test_sigkill_of_every_rank_mid_save_never_mixes_two_saves(tmp_path) -> None:
    """torchrun's ranks SIGKILLed at random moments of a save loop: the path always loads whole,
    each tensor holds the version its metadata says, and versions never go backwards."""
    import random
    import signal

    path = str(tmp_path / "ckpt")
    rng = random.Random(7)
    last = 0
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(train_helpers._free_port()),
                                 os.path.join(train_helpers.ROOT, "tests", "sharded_save_loop.py"), path,
                                 str(1000 * (round_ + 1))],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True, cwd=train_helpers.ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            for _line in range(2):
                assert proc.stdout.readline().startswith("saved"), "the loop saved nothing"
            time.sleep(rng.uniform(0.0, 0.3))
        finally:  # torchrun starts each rank in a session of its own: kill every process of the tree
            tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            psutil.wait_procs([p for p in map(_process, tree) if p is not None], timeout=10)
        model = sh.build("plain", 3)
        version = load_checkpoint(path, model=model, restore_rng=False)["version"]
        assert all(torch.all(p == float(version)) for p in model.parameters()), version
        assert version >= last
        last = version
    assert last > 1000


def test_crafted_metadata_is_refused_without_running_code(tmp_path) -> None:
    path = tmp_path / "evil"
    model = sh.build("plain", 0)
    save_checkpoint(str(path), model=model, sharded=True)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"refused to load .*\.metadata: it names the Python object "
                                              r"(posix|os)\.system"):
        load_checkpoint(str(path), model=model)
    assert not marker.exists()


def test_crafted_value_in_the_shards_is_refused_without_running_code(tmp_path) -> None:
    """DCP itself reads non-tensor values with weights_only=False; ours does not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    model = sh.build("tp_plain", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sh.train_step(model, opt, "tp_plain")
    msd, osd = get_state_dict(model, opt)
    next(iter(osd["param_groups"]))["lr"] = Evil()
    path = str(tmp_path / "evil")
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused to load the value"):
        load_checkpoint(path, model=model, optimizer=opt, restore_rng=False)
    assert not marker.exists()


def test_a_folder_of_other_files_is_never_replaced(tmp_path) -> None:
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "train.csv").write_text("1,2\n")
    with pytest.raises(ClorchError, match="holds no checkpoint"):
        save_checkpoint(str(data), model=sh.build("plain", 0), sharded=True)
    assert (data / "train.csv").read_text() == "1,2\n"
    with pytest.raises(ConfigError, match="async_save=True writes the sharded format"):
        save_checkpoint(str(tmp_path / "x.pt"), model=sh.build("plain", 0), async_save=True)


def test_a_single_file_replaced_by_a_sharded_save_and_back(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    model = sh.build("plain", 0)
    save_checkpoint(path, model=model, state={"v": 1})
    save_checkpoint(path, model=model, sharded=True, state={"v": 2})  # the file becomes a folder
    assert os.path.isdir(path) and load_checkpoint(path, model=model) == {"v": 2}
    with pytest.raises(ClorchError, match="is a folder"):
        save_checkpoint(path, model=model, state={"v": 3})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fsdp_overflow_in_one_shard_skips_the_step_everywhere(dtype) -> None:
    results = train_helpers.run_ranks("tests.sharded_helpers:fsdp_scaled_steps", nproc=2, args={"dtype": dtype})
    for r in results:
        assert r["stepped"] == [True, False, True], r
        assert r["changed"] == [True, False, True], r  # the skipped step left every shard as it was
        assert r["scales"] == [1024.0, 512.0, 512.0], r  # the scale backed off the same everywhere
        assert r["inside_no_sync"] and "ran inside no_sync" in r["inside_no_sync"]
        assert r["after_no_sync"] is True


def test_a_rank_that_refuses_alone_is_named_and_no_rank_hangs(tmp_path) -> None:
    """FSDP1's optimizer state dict takes collectives: a rank that refused a save (rank 0: the target
    is a folder of other files) or failed reading a load's metadata (rank 1) must not leave the
    others inside them, waiting for it. Every rank refuses, naming the rank, and the model is
    unchanged."""
    results = train_helpers.run_ranks("tests.sharded_helpers:fsdp1_unreadable_metadata_on_one_rank", nproc=2,
                                      args={"path": str(tmp_path / "fsdp1")}, timeout_s=120)
    for r in results:
        assert r["error"] is not None and "CheckpointError" in r["error"], r
        assert "rank 1" in r["error"] and "-broken" in r["error"], r["error"]
        assert r["refused_save"] is not None and "-other" in r["refused_save"], r["refused_save"]
        assert r["unchanged"], r


def test_an_fsdp1_model_saves_sharded_by_default_and_loads_back_exactly(tmp_path) -> None:
    """FSDP1 (``FullyShardedDataParallel``) holds flat shards, not DTensors; a single file written
    by rank 0 alone would take its full state dict's collectives on rank 0 only. The default
    decides for the sharded format, as for FSDP2."""
    results = train_helpers.run_ranks("tests.sharded_helpers:fsdp1_round_trip", nproc=2,
                                      args={"path": str(tmp_path / "fsdp1")}, timeout_s=120)
    assert [r["folder"] for r in results] == [True, True], results
    assert [r["exact"] for r in results] == [True, True], results
