"""Checkpoints with real processes: saved and loaded by 2 ranks of a real gloo group, and SIGKILL
in the middle of a save always leaving a loadable checkpoint. In one process: tests/unit/test_checkpoint.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch

from clorch_repl.distributed import load_checkpoint, save_checkpoint
from tests import train_helpers


ROOT = train_helpers.ROOT


def test_multi_rank_save_and_load(tmp_path) -> None:
    results = train_helpers.run_ranks("tests.train_helpers:checkpoint_checks", nproc=2,
                                      args={"path": str(tmp_path / "ranks.pt")})
    for r in results:
        assert r["state"] == {"epoch": 3, "global_step": 42, "note": "from rank 0"}  # rank zero wrote
        assert r["rng_torch_equal"] and r["rng_python_equal"], r  # each rank got its own RNG back
        assert r["weights_equal"] and r["optimizer_state_equal"]
        assert r["sampler"]["rank"] == r["rank"] and r["sampler"]["position"] == 10 + r["rank"]
        assert r["scale"] == 512.0
        assert r["mismatch_error"].startswith("CheckpointError: loading the checkpoint failed on rank 1:")
        assert "nothing was changed on any rank" in r["mismatch_error"]
        assert r["mismatch_unchanged"]
        assert "failed on rank 1" in r["bad_state_error"] and r["file_untouched"]


def test_sigkill_during_save_always_leaves_a_loadable_checkpoint(tmp_path) -> None:
    """A writer SIGKILLed at random moments, 25 times: the path always loads, weights and
    metadata always belong together, and versions never go backwards."""
    path = tmp_path / "ckpt.pt"
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.0)
    save_checkpoint(path, model=model, state={"version": 0})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-c", "import tests.train_helpers as h; h.save_loop_server()",
                               str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                              cwd=ROOT)
    rng = random.Random(1234)
    last_version, mid_write, rounds = 0, 0, 25
    try:
        for i in range(1, rounds + 1):
            server.stdin.write(f"go {i * 100000}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.35))
            os.kill(pid, signal.SIGKILL)
            server.stdin.write(f"reap {pid}\n")
            server.stdin.flush()
            assert server.stdout.readline().strip() == "reaped"
            if any(".clorch-tmp." in name for name in os.listdir(tmp_path)):
                mid_write += 1
            state = load_checkpoint(path, model=model, restore_rng=False)
            version = state["version"]
            assert all(torch.all(p == float(version)) for p in model.parameters()), (i, version)
            assert version >= last_version
            last_version = version
    finally:
        if server.poll() is None:
            server.stdin.write("quit\n")
            server.stdin.flush()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    assert mid_write >= 3, f"only {mid_write} of {rounds} kills landed during a write"
    assert last_version > 0
    save_checkpoint(path, model=model, state={"version": -1})  # the next save removes the dead writers' files
    deadline = time.monotonic() + 10  # the replaced checkpoint is deleted in the background
    while os.listdir(tmp_path) != ["ckpt.pt"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(tmp_path) == ["ckpt.pt"]
