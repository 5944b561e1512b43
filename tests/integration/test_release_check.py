"""The release check as CI runs it: a subprocess, a table, and the exit status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clorch_repl.release_check", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


def test_cpu_mode_passes_and_prints_a_table() -> None:
    proc = run("--mode", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("collectives", "ddp backward", "gradient accumulation", "amp overflow handling", "checkpoints",
                 "worker failure", "process cleanup"):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert " PASS " in line, line
    assert "0 failed" in proc.stdout


def test_gpu_mode_without_a_gpu_fails_with_a_reason() -> None:
    from clorch_repl import cuda

    if cuda.device_count() > 0:
        pytest.skip("this machine has a GPU")
    proc = run("--mode", "gpu", timeout=120)
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "no usable CUDA device" in proc.stdout
