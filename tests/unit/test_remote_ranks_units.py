"""Called-back ranks before any process: a rank's place read from torchrun's or Slurm's variables,
and bad launcher options refused by %clorch start in one line. The ranks themselves:
tests/integration/test_remote_ranks.py."""

from __future__ import annotations

import re

import pytest

from clorch_repl.wire.rank_env import Identity, read_identity


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, Identity(3, 1, 4, 2, "torchrun")),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x2),2",
      "SLURM_NODEID": "2"}, Identity(5, 1, 6, 2, "slurm")),
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1",
      "SLURM_NODEID": "1"}, Identity(0, 0, 3, 1, "slurm")),
])
def test_a_rank_reads_its_place_from_torchrun_or_slurm(env: dict[str, str], expected: Identity) -> None:
    assert read_identity(env) == expected


@pytest.mark.parametrize("line, message", [
    ("--launcher nope", "--launcher 'nope' is not known; the launchers are: attach, local, slurm"),
    ("--launcher attach --nodes 2", "--launcher attach needs --nproc-per-node"),
    ("--launcher slurm --nodes 0 --nproc-per-node 1", "--nodes must be a whole number >= 1"),
    ("--launcher attach --nproc-per-node 1 --listen 0.0.0.0", "--listen 0.0.0.0 would listen on every interface"),
    ("--launcher attach --nproc-per-node 1 --listen nbhost", "--listen must be an IP address"),
    ("--launcher attach --nproc-per-node 1 --nproc 2", "--nproc and --devices are for --launcher local"),
    ("--launcher attach --nproc-per-node 1 --orphan-timeout -1", "--orphan-timeout must be a positive number"),
    ("--cpu-bind all", "--cpu-bind must be numa or none"),
    ("--spares 2", "--spares must be 0 (no warm spares) or 1 (one per rank); got '2'"),
    ("--spares yes", "--spares must be 0 (no warm spares) or 1"),
])
def test_start_refuses_bad_launcher_options_in_one_line(ip, line: str, message: str) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_line_magic("clorch", f"start {line}")
