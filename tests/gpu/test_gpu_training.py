"""GPU checks for the device machine (one NCCL rank per GPU); skipped where there is no GPU.

Run: ``python -m pytest -q tests/gpu/test_gpu_training.py -s`` (``-s`` shows what the runs printed).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clorch_repl import cuda

pytestmark = pytest.mark.skipif(cuda.device_count() == 0, reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_run_local_one_nccl_rank(precision: str, tmp_path) -> None:
    from clorch_repl.examples.distributed_training import run_local

    result = run_local([0], epochs=4, sample_count=1024, batch_size=32, accumulation=2, precision=precision,
                       checkpoint_path=str(tmp_path / f"ddp-{precision}.pt"))
    print(result.logs[0])
    print(f"{precision}: backend {result.backend}, {len(result.losses[0])} steps, final loss "
          f"{result.final_loss:.5f}, skipped {result.skipped_steps[0]}, {result.elapsed_s:.1f}s")
    assert result.backend == "nccl"
    assert len(result.losses[0]) == 4 * (1024 // 32) // 2
    assert result.losses[0][-1] < result.losses[0][0]
    assert result.rank_devices == {0: "cuda:0"}, result.rank_devices  # it trained on the GPU, not the CPU
    assert os.path.exists(result.checkpoint_path)
    # resume from the last (end of training) checkpoint into a longer run: it continues, on the GPU
    more = run_local([0], epochs=5, sample_count=1024, batch_size=32, accumulation=2, precision=precision,
                     checkpoint_path=result.checkpoint_path, resume=True)
    assert "resumed from" in more.logs[0] and len(more.losses[0]) == (1024 // 32) // 2


def test_release_check_gpu_mode() -> None:
    proc = subprocess.run([sys.executable, "-m", "clorch_repl.release_check", "--mode", "gpu"], cwd=ROOT,
                          text=True, capture_output=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
