"""The pure parts of the checkpoint defects a user try-out found (with real sessions:
tests/integration/test_checkpoint_tryout.py): the frames of contextlib that run clorch's own
context managers are cut from a refusal's traceback like clorch's own frames, a file that is no
checkpoint is called that for a sharded model too, and a rank given rank 0's RNG state is warned
at the user's line."""

from __future__ import annotations

import contextlib
import inspect
import types
import warnings

import pytest
import torch

from clorch_repl.common.user_frames import users_frames
from clorch_repl.errors import CheckpointError, ConfigError
from clorch_repl.training.checkpoint import load_checkpoint, ranks, read_checkpoint_metadata, save_checkpoint
from clorch_repl.training.checkpoint.extras import apply_extras
from clorch_repl.training.checkpoint.rank_state import rng_state


def _frames(tb: types.TracebackType | None) -> list[tuple[str, int]]:
    out = []
    while tb is not None:
        out.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _refused_in_agreement(fails_here: bool) -> CheckpointError:
    """The error of ``ranks.agreed`` as the rank that failed (contextlib's ``__exit__`` throws into
    the generator) or a rank that was told (``__exit__`` calls ``next()`` on it) sees it."""
    try:
        with ranks.agreed("saving the checkpoint", "preparing the checkpoint failed"):
            if fails_here:
                raise ConfigError("/data is a folder that holds no checkpoint")
    except CheckpointError as exc:
        return exc
    raise AssertionError("the agreement raised nothing")


def test_contextlib_frames_of_clorchs_context_managers_are_cut_so_the_ranks_match(monkeypatch) -> None:
    monkeypatch.setattr(ranks, "gather", lambda error, group=None: [error, None])  # as rank 0 of 2
    failed = _refused_in_agreement(True)
    monkeypatch.setattr(ranks, "gather", lambda error, group=None: ["/data is a folder that holds no checkpoint",
                                                                    error])  # as rank 1, told of rank 0's
    told = _refused_in_agreement(False)
    assert str(failed) == str(told)
    shown = _frames(users_frames(failed.__traceback__))
    assert any(f.endswith("contextlib.py") for f, _ in _frames(failed.__traceback__))
    assert shown == _frames(users_frames(told.__traceback__)) == [(__file__, shown[0][1])], shown


def test_contextlib_frames_running_the_users_own_context_manager_are_kept(tmp_path) -> None:
    @contextlib.contextmanager
    def users_block():
        yield
        read_checkpoint_metadata(tmp_path / "absent.pt")  # clorch refuses on the way out

    with pytest.raises(CheckpointError) as caught:
        with users_block():
            pass
    files = [f for f, _ in _frames(users_frames(caught.value.__traceback__))]
    assert files[-1] == __file__ and any(f.endswith("contextlib.py") for f in files), files
    assert not any("clorch_repl" in f for f in files), files


def test_a_text_file_is_no_checkpoint_for_a_sharded_model(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    (tmp_path / "notes.txt").write_text("plain text\n")
    save_checkpoint(tmp_path / "plain.pt", model=torch.nn.Linear(2, 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)),
                                                            [Shard(0)]))
        with pytest.raises(CheckpointError, match=r"notes.txt is truncated or not a checkpoint file \(File is not a zip"):
            load_checkpoint(tmp_path / "notes.txt", model=model)
        with pytest.raises(ConfigError, match=r"plain.pt is a single-file checkpoint \(an unsharded model's\) and the "
                                              r"model is sharded"):
            load_checkpoint(tmp_path / "plain.pt", model=model)
    finally:
        dist.destroy_process_group()


def test_a_rank_past_the_saved_ones_is_warned_at_the_users_line() -> None:
    payload = {"rng": [rng_state()]}  # saved by 1 rank: this process's own state, so restoring changes nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_extras(payload, None, None, None, True, 0)
        assert not caught, "rank 0 resumed its own state"
        line = inspect.currentframe().f_lineno + 1  # the next line: the call a warning must name
        apply_extras(payload, None, None, None, True, 1)
    (warning,) = caught
    assert warning.category is RuntimeWarning and (warning.filename, warning.lineno) == (__file__, line)
    assert str(warning.message) == (
        "load_checkpoint: rank 1 resumed rank 0's random state (the checkpoint was saved by 1 rank), so ranks 0 "
        "and 1 now draw the same random numbers (dropout, augmentation); to make them differ, reseed after "
        "loading, e.g. torch.manual_seed(seed + rank)")
