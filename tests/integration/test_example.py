"""The shipped example, run as a user would: run_local on 2 CPU gloo ranks, and resuming it."""

from __future__ import annotations

import pytest

from clorch_repl.training.checkpoint import read_checkpoint_metadata
from clorch_repl.errors import ConfigError
from clorch_repl.examples.distributed_training import TrainingResult, run_local


def test_run_local_trains_and_checkpoints(tmp_path) -> None:
    result = run_local([0, 1], epochs=2, sample_count=1024, batch_size=32, accumulation=2,
                       precision="bfloat16", checkpoint_path=str(tmp_path / "ddp.pt"))
    assert isinstance(result, TrainingResult)
    assert result.world_size == 2 and result.precision == "bfloat16"
    steps = 2 * (512 // 32) // 2  # 16 micro-batches per rank and epoch, 2 per step
    assert [len(result.losses[r]) for r in (0, 1)] == [steps, steps]
    assert result.param_digests[0] == result.param_digests[1]  # the replicas stayed identical
    first, last = result.losses[0][:4], result.losses[0][-4:]
    assert sum(last) < 0.8 * sum(first)  # it learns
    assert "epoch 2/2" in result.logs[0] and "epoch 2/2" in result.logs[1]
    assert result.state == {"epoch": 2, "global_step": steps}
    meta = read_checkpoint_metadata(result.checkpoint_path)
    assert meta["state"]["global_step"] == steps and meta["world_size"] == 2


def test_resume_continues_bit_identically(tmp_path) -> None:
    options = dict(epochs=2, sample_count=512, batch_size=16, accumulation=2, precision="float16",
                   checkpoint_every=3)
    full = run_local([0, 1], checkpoint_path=str(tmp_path / "full.pt"), **options)
    part = run_local([0, 1], checkpoint_path=str(tmp_path / "part.pt"), stop_after_steps=3, **options)
    resumed = run_local([0, 1], checkpoint_path=str(tmp_path / "part.pt"), resume=True, **options)
    for rank in (0, 1):
        assert part.losses[rank] == full.losses[rank][:3]
        assert resumed.losses[rank] == full.losses[rank][3:]  # exact float equality, mid-epoch resume
    assert resumed.param_digests == full.param_digests
    assert "resumed from" in resumed.logs[1] and "step 3" in resumed.logs[1]


def test_bad_options_are_refused_before_launching() -> None:
    with pytest.raises(ConfigError, match="precision"):
        run_local([0, 1], precision="int8")
    with pytest.raises(ConfigError, match="devices is empty"):
        run_local([])
    with pytest.raises(ConfigError, match="accumulation"):
        run_local([0], accumulation=0)
    with pytest.raises(ConfigError, match="unknown training option"):
        run_local([0], bogus=1)


def test_the_script_runs_from_anywhere(tmp_path) -> None:
    """``python examples/distributed_training.py`` from another folder, with the repository off
    PYTHONPATH: the script and the launched ranks import the example from the installed package."""
    import os
    import subprocess
    import sys

    from test_notebooks_training import ROOT, env_without_repository

    checkpoint = tmp_path / "script.pt"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "distributed_training.py"),
                           "--devices", "0,1", "--epochs", "1", "--sample-count", "256",
                           "--checkpoint-path", str(checkpoint)],
                          cwd=tmp_path, env=env_without_repository(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1: epoch 1/1" in done.stdout and f"checkpoint at {checkpoint}" in done.stdout
    assert checkpoint.exists()
