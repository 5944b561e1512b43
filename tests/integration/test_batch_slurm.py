"""``dist.launch(..., launcher="slurm")``: batch jobs as one srun step on a real two-node Slurm
cluster of simulated hosts (tests/cluster.py; needs root). The job directory (log_dir) is on the
filesystem the "nodes" share with the notebook, as a cluster's home directory would be."""

from __future__ import annotations

import pytest

from clorch_repl import distributed as dist
from clorch_repl.errors import ConfigError, RankFailure
from cluster import two_hosts, two_hosts_clean  # noqa: F401

pytestmark = pytest.mark.hosts


@pytest.fixture()
def slurm_env(two_hosts_clean, monkeypatch):  # noqa: F811
    for key, value in two_hosts_clean.slurm_env().items():
        monkeypatch.setenv(key, value)
    return two_hosts_clean


def test_a_batch_job_spans_both_nodes_through_srun(slurm_env, tmp_path) -> None:
    job = dist.launch(main="hosts_workers:where", launcher="slurm", nodes=2, nproc_per_node=2,
                      log_dir=str(tmp_path), timeout_ms=120_000)
    results = job.wait(timeout=150)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["host"] for r in results} == {"hostA", "hostB"}
    assert all(r["sum"] == 10.0 and r["world_size"] == 4 for r in results)
    assert sorted(r["local_rank"] for r in results) == [0, 0, 1, 1]
    assert job.status().state == "succeeded"
    assert slurm_env.wait_no_jobs(timeout=15) == []


def test_a_failing_rank_on_the_second_node_is_named_and_the_step_ends(slurm_env, tmp_path) -> None:
    job = dist.launch(main="hosts_workers:fail_on_last", launcher="slurm", nodes=2, nproc_per_node=1,
                      log_dir=str(tmp_path), timeout_ms=120_000, pg_timeout_s=60)
    with pytest.raises(RankFailure) as info:
        job.wait(timeout=150)
    assert info.value.rank == 1 and "rank 1 fails on hostB" in str(info.value)
    assert "ValueError" in job.logs(1)  # srun wrote the task's output to the job's rank-1.log
    assert slurm_env.wait_no_jobs(timeout=20) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"launcher": "mpi"}, "launcher must be 'local' or 'slurm'"),
    ({"launcher": "slurm", "nodes": 2}, "launcher='slurm' needs nproc_per_node"),
    ({"launcher": "slurm", "nproc_per_node": 1, "devices": [0]}, "devices is for launcher='local'"),
    ({"nodes": 2, "nproc_per_node": 1}, "nodes=2 needs launcher='slurm'"),
    ({"launcher": "slurm", "nodes": 2, "nproc_per_node": 1}, "launcher='slurm' needs log_dir on a filesystem"),
])
def test_bad_launcher_arguments_are_refused_before_anything_starts(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        dist.launch(main="hosts_workers:where", **kwargs)
