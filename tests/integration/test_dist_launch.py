"""launch() and Job on real processes: training, failures (raise, SIGKILL), timeout, stop, logs,
the registry. Bad input refused before a process starts: tests/unit/test_dist_launch_units.py."""

from __future__ import annotations

import os
import stat
import time

import pytest

import dist_helpers  # noqa: F401  (puts this folder on sys.path for the ranks)
import dist_workers

from clorch_repl import distributed as dist
import clorch_repl.distributed as launch_mod  # jobs() and get_job() live here too
from clorch_repl.errors import ConfigError, RankFailure
from clorch_repl.common.procs import pid_running, wait_gone

FAST_FAIL_S = 15.0  # fail fast: the surviving rank sleeps 600 s unless the job ends it


def _wait_for_log(job: dist.Job, rank: int, marker: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = job.logs(rank)
        if marker in text:
            return text
        if job.done():
            break
        time.sleep(0.05)
    raise AssertionError(f"{marker!r} never reached rank {rank}'s log; log:\n{job.logs(rank)}\n{job.status()}")


def test_launch_trains_a_small_model() -> None:
    job = dist.launch(nproc_per_node=2, main="dist_workers:train_small", args={"steps": 40}, timeout_ms=120_000)
    assert job.id.startswith("job-") and launch_mod.get_job(job.id) is job
    results = job.wait()
    assert [len(r["losses"]) for r in results] == [40, 40]
    losses = results[0]["losses"]
    assert losses[-1] < losses[0] / 10, losses
    assert results[0]["losses"] == results[1]["losses"]  # the averaged loss agrees on every rank
    assert results[0]["params"] == results[1]["params"]  # averaged gradients keep the replicas equal
    status = job.status()
    assert status.state == "succeeded" and [r.state for r in status.ranks] == ["succeeded", "succeeded"]
    assert [r.exit_code for r in status.ranks] == [0, 0]
    assert "final loss" in job.logs(1)
    assert "succeeded" in status.summary() and job.id in repr(job)
    with pytest.raises(ConfigError, match="has ranks 0-1; got rank"):
        job.logs(2)
    assert launch_mod.jobs()[-1] is job
    from clorch_repl.jobs.batch import get_job, jobs

    assert jobs()[-1] is job and get_job(job.id) is job and dist.jobs()[-1] is job


def test_a_raising_rank_is_named_and_the_others_stop_fast() -> None:
    start = time.monotonic()
    job = dist.launch(nproc_per_node=2, main=dist_workers.fail_one, timeout_ms=120_000,
                      args={"fail_rank": 1, "how": "raise", "others": "sleep"})
    with pytest.raises(RankFailure) as info:
        job.wait()
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    text = str(err)
    assert text.startswith("rank 1 failed first") and "ValueError: boom from rank 1" in text
    assert 'raise ValueError(f"boom from rank {r}")' in text  # the rank's traceback
    assert elapsed < FAST_FAIL_S, f"rank 0 was not stopped fast ({elapsed:.1f} s)"
    status = job.status()
    assert status.state == "failed" and status.first_failed_rank == 1
    assert status.ranks[1].state == "failed" and status.ranks[0].state == "stopped"
    assert not any(pid_running(pid) for pid in job.pids())


def test_a_sigkilled_rank_is_the_cause_not_the_cascade() -> None:
    job = dist.launch(nproc_per_node=2, main="dist_workers:fail_one", timeout_ms=120_000,
                      args={"fail_rank": 1, "how": "sigkill", "others": "collective"})
    with pytest.raises(RankFailure) as info:
        job.wait()
    assert info.value.rank == 1
    assert "killed by signal SIGKILL" in str(info.value)
    assert "rank 1 about to fail" in str(info.value)  # the log tail stands in for a traceback
    status = job.status()
    assert status.first_failed_rank == 1 and status.ranks[1].exit_code == -9
    assert "rank 1 failed first" in status.message
    assert not any(pid_running(pid) for pid in job.pids())


def test_timeout_ends_the_job() -> None:
    job = dist.launch(nproc_per_node=2, main="dist_workers:chatty_then_sleep", timeout_ms=4_000)
    with pytest.raises(dist.JobTimeout, match=r"timed out after 4 s \(timeout_ms=4000\)"):
        job.wait(timeout=60)
    status = job.status()
    assert status.state == "timed_out"
    assert [r.state for r in status.ranks] == ["stopped", "stopped"]
    assert not any(pid_running(pid) for pid in job.pids())


def test_a_timeout_before_the_ranks_are_up_stops_them() -> None:
    # The flake of test_timeout_ends_the_job made certain: at 0.3 s the ranks are still importing
    # torch; the timeout's probe used to kill them ("failed", "killed by signal SIGUSR2").
    job = dist.launch(nproc_per_node=2, main="dist_workers:chatty_then_sleep", timeout_ms=300)
    with pytest.raises(dist.JobTimeout, match=r"timed out after 0.3 s \(timeout_ms=300\)"):
        job.wait(timeout=60)
    status = job.status()
    assert [r.state for r in status.ranks] == ["stopped", "stopped"], status
    assert not any("SIGUSR2" in r.exit for r in status.ranks), status
    assert not any(pid_running(pid) for pid in job.pids())


def test_a_timeout_while_ranks_start_does_not_kill_them_with_the_probe(tmp_path) -> None:
    # What made test_timeout_ends_the_job flaky under load: the probe (SIGUSR2, whose default
    # action ends a process) reached a rank still importing torch. A process that has not said it
    # serves the probe is not asked, and lives on; once it has, it is asked.
    import subprocess
    import sys

    from clorch_repl.diagnosis import jobs

    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert jobs.explain(str(tmp_path), {0: starting.pid}, {}) is None
        assert starting.poll() is None, "the probe killed a rank that was still starting"
        open(jobs.ready_path(str(tmp_path), 0), "w").close()
        jobs.explain(str(tmp_path), {0: starting.pid}, {})  # now asked: it does not serve it, so it dies
        assert starting.wait(timeout=10) == -jobs.SIGNAL
    finally:
        if starting.poll() is None:
            starting.kill()
            starting.wait()


def test_logs_hold_python_and_native_output_and_stop_ends_every_rank() -> None:
    job = dist.launch(nproc_per_node=2, main="dist_workers:chatty_then_sleep", timeout_ms=120_000)
    with job:
        for r in range(2):
            text = _wait_for_log(job, r, f"READY {r}")
            for line in (f"python print from rank {r}", f"fd1 write from rank {r}", f"fd2 write from rank {r}",
                         f"libc printf from rank {r}"):
                assert line in text, f"{line!r} missing from rank {r}'s log:\n{text}"
            assert job.logs(r, tail=1).strip() == f"READY {r}"
            mode = stat.S_IMODE(os.stat(job.log_path(r)).st_mode)
            assert mode == 0o600, oct(mode)
        assert stat.S_IMODE(os.stat(job.dir).st_mode) == 0o700
        store = os.path.join(job.dir, "rendezvous.store")  # the group's keys: this user's alone too
        assert stat.S_IMODE(os.stat(store).st_mode) == 0o600, oct(os.stat(store).st_mode)
        assert job.status().state == "running"
        pids = job.pids()
        assert all(pid_running(pid) for pid in pids)
        status = job.stop(grace_s=5)
    assert status.state == "stopped" and [r.state for r in status.ranks] == ["stopped", "stopped"]
    assert wait_gone(pids, 1.0) == []
    with pytest.raises(dist.JobStopped):
        job.wait()


def test_registry_lists_jobs_in_start_order() -> None:
    listed = launch_mod.jobs()
    ids = [j.id for j in listed]
    assert len(set(ids)) == len(ids)
    assert [int(i.split("-")[1]) for i in ids] == sorted(int(i.split("-")[1]) for i in ids)
    if listed:
        last = listed[-1]
        assert launch_mod.get_job(last.id) is last
        assert launch_mod.get_job(int(last.id.split("-")[1])) is last
    with pytest.raises(ConfigError, match="no job 'job-99999'"):
        launch_mod.get_job("job-99999")
