"""placement.srun's step on a real two-node Slurm cluster (tests/cluster.py; needs root): how a
step is cancelled once srun can no longer end it. Inside an allocation (a notebook under salloc, an
sbatch job) ``srun --job-name`` names only the step and ``scancel --name`` matches job names, so
the step is cancelled by its id; outside one srun's own job bears the name."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time

import pytest

from clorch_repl.placement.srun import SrunStep, srun_command
from cluster import two_hosts, two_hosts_clean  # noqa: F401

pytestmark = pytest.mark.hosts

#: a session's step name is "clorch-" and its id: long, and squeue must give it whole
NAME = "clorch-" + "0123456789abcdef" * 2


def _steps(job: str) -> list[str]:
    out = subprocess.run(["squeue", "--steps", "-j", job, "-h", "-o", "%i %j"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()[1:] == [NAME]]


def _wait_steps(job: str, present: bool, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    steps = _steps(job)
    while bool(steps) != present and time.monotonic() < deadline:
        time.sleep(0.2)
        steps = _steps(job)
    return steps


def _wait_tasks(cluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(cluster.processes_in(h) for h in ("hostA", "hostB")) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture()
def slurm_env(two_hosts_clean, monkeypatch):  # noqa: F811
    for key, value in two_hosts_clean.slurm_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    return two_hosts_clean


@pytest.fixture()
def allocation(slurm_env, monkeypatch):
    """Both nodes held by ``salloc --no-shell``; SLURM_JOB_ID names it, as in salloc's shell."""
    done = subprocess.run(["salloc", "--no-shell", "-N2", "-J", "clorch-test-alloc"], capture_output=True, text=True,
                          timeout=60)
    found = re.search(r"job allocation (\d+)", done.stdout + done.stderr)
    assert found, f"salloc gave no allocation: {done.stdout} {done.stderr}"
    job = found.group(1)
    monkeypatch.setenv("SLURM_JOB_ID", job)
    yield job
    subprocess.run(["scancel", job], capture_output=True, timeout=30)
    slurm_env.wait_no_jobs(timeout=15)


def test_a_step_inside_an_allocation_is_cancelled_by_its_id(allocation, tmp_path) -> None:
    step = SrunStep.start(srun_command(2, 1, NAME) + ["sleep", "300"], env=os.environ, name=NAME, what="test step",
                          log_path=str(tmp_path / "srun.log"))
    try:
        ids = _wait_steps(allocation, present=True, timeout=30)
        assert ids == [f"{allocation}.0"], f"the step did not start: {step.said()}"
        assert step.allocation == allocation
        # the backstop before: scancel --name matches job names, never a step's
        subprocess.run(["scancel", f"--name={NAME}"], capture_output=True, timeout=30)
        time.sleep(2)
        assert _steps(allocation) == ids and step.poll() is None, "scancel --name reached a step after all"

        step.cancel()  # srun still alive: only the cancel can have ended the step
        assert _wait_steps(allocation, present=False, timeout=30) == [], "the step outlived its cancel"
        assert step.process.wait(timeout=30) is not None
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
        assert jobs == [allocation], "the cancel reached more than the step"
    finally:
        if step.poll() is None:
            step.process.kill()
            step.process.wait()


def test_a_killed_sruns_job_outside_an_allocation_is_cancelled_by_name(slurm_env, tmp_path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Outside an allocation srun's own job bears the name. srun is stopped (SIGSTOP: a hung
    srun, which cannot act on its SIGTERM), so end() takes its SIGKILL path and cancels by name;
    nothing is left. (Slurm 22.05 also ends a SIGKILLed srun's step by itself
    within seconds, so this shows the path runs and reaches the job, not that it was needed.)"""
    step = SrunStep.start(srun_command(2, 1, NAME) + ["sleep", "300"], env=os.environ, name=NAME,
                          what="test step", log_path=str(tmp_path / "srun.log"))
    assert step.allocation is None
    _wait_tasks(slurm_env)
    os.kill(step.process.pid, signal.SIGSTOP)
    with caplog.at_level(logging.INFO, logger="clorch_repl.placement.srun"):
        step.end(term_wait_s=1.0)
    assert step.poll() == -9, f"srun was not killed: {step.said()}"
    assert f"scancel --name={NAME}" in caplog.text, caplog.text
    assert slurm_env.wait_no_jobs(timeout=30) == [], "srun's job outlived its end"


def test_a_hung_sruns_step_inside_an_allocation_is_gone_after_its_end(allocation, slurm_env, tmp_path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The whole end() of a hung srun (SIGSTOP) in an allocation: SIGTERM, SIGKILL, then the
    step's cancel by id (or, where Slurm was quicker, the step already gone); the allocation stays."""
    step = SrunStep.start(srun_command(2, 1, NAME) + ["sleep", "300"], env=os.environ, name=NAME,
                          what="test step", log_path=str(tmp_path / "srun.log"))
    assert _wait_steps(allocation, present=True, timeout=30), f"the step did not start: {step.said()}"
    # its tasks running on both nodes first: a step shows in squeue before srun has launched them,
    # and one stopped in the middle of its launch once lingered 30 s after its scancel
    _wait_tasks(slurm_env)
    os.kill(step.process.pid, signal.SIGSTOP)
    with caplog.at_level(logging.INFO, logger="clorch_repl.placement.srun"):
        step.end(term_wait_s=1.0)
    assert step.poll() == -9
    assert f"scancel {allocation}.0" in caplog.text or "already gone" in caplog.text, caplog.text
    left = _wait_steps(allocation, present=False, timeout=30)
    assert left == [], f"the step outlived its end; srun said: {step.said()}\n{slurm_env.logs_tail(12)}"
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
    assert jobs == [allocation]
