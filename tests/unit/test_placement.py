"""The placement layer's pure parts (clorch_repl.placement, issue 33), without a process: srun's
command line and its printed form, a job's time limit, Slurm's task variables, a step's end in the
order it must go, the topology of ranks on nodes, a local rank's place. The steps and ranks
themselves: tests/integration/test_batch_slurm.py, test_multihost.py, test_launchers.py."""

from __future__ import annotations

import logging
import os
import shlex
import socket
import subprocess
import time
from typing import Any

import psutil
import pytest

from clorch_repl.common.topology import Topology, nodes_topology
from clorch_repl.errors import ConfigError
from clorch_repl.placement import srun as srun_mod
from clorch_repl.placement import teardown
from clorch_repl.placement.slurm_tasks import TaskPlace, task_place, tasks_per_node
from clorch_repl.placement.srun import SrunStep, srun_command, srun_hint, time_limit
from clorch_repl.wire.rank_env import local_place


def test_srun_gets_one_task_per_rank_and_the_users_arguments_last() -> None:
    assert srun_command(2, 4, "clorch-abc") == [
        "srun", "--nodes=2", "--ntasks-per-node=4", "--ntasks=8", "--kill-on-bad-exit=0", "--job-name=clorch-abc"]
    cmd = srun_command(1, 2, "clorch-j", partition="gpu", time="5", output="/shared/rank-%t.log",
                       srun_args='--gres=gpu:2 --comment "two words"')
    assert cmd[6:] == ["--partition=gpu", "--time=5", "--output=/shared/rank-%t.log", "--gres=gpu:2",
                       "--comment", "two words"]


def test_srun_arguments_that_a_shell_could_not_split_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="srun_args cannot be split like a shell line"):
        srun_command(1, 1, "clorch-x", srun_args='--comment "unclosed')


@pytest.mark.parametrize("nodes, per_node", [(3, 2), (1, 8)])
def test_the_printed_srun_line_has_the_same_layout(nodes: int, per_node: int) -> None:
    """The printed line's options, read as srun reads them, are the ones srun_command runs with
    (both come from task_layout): a change to one layout shows in the other."""
    words = shlex.split(srun_hint(nodes, per_node))
    assert words[0] == "srun" and words[-3:] == ["python", "-m", "clorch_repl.rank"]
    printed = [f"{opt}={value}" for opt, value in zip(words[1:-3:2], words[2:-3:2])]
    run = srun_command(nodes, per_node, "clorch-x")
    assert printed and all(word in run for word in printed), (printed, run)
    assert {w.partition("=")[0] for w in printed} == {"--nodes", "--ntasks-per-node"}


@pytest.mark.parametrize("timeout_s, minutes", [(None, None), (1.0, "1"), (60.0, "1"), (61.0, "2"), (3600.0, "60")])
def test_a_jobs_timeout_becomes_whole_minutes_of_srun_time(timeout_s: float | None, minutes: str | None) -> None:
    assert time_limit(timeout_s) == minutes


@pytest.mark.parametrize("spec, node, count", [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), (" 4 , 1(x2)", 2, 1)])
def test_slurms_compressed_task_counts_are_expanded(spec: str, node: int, count: int) -> None:
    assert tasks_per_node(spec, node) == count


@pytest.mark.parametrize("spec, node, message", [
    ("2(x)", 0, "cannot read SLURM_STEP_TASKS_PER_NODE='2\\(x\\)'"),
    ("2,1", 2, "SLURM_NODEID=2 is outside SLURM_STEP_TASKS_PER_NODE='2,1'"),
])
def test_task_counts_that_cannot_be_read_say_which_variable(spec: str, node: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tasks_per_node(spec, node)


def test_a_tasks_place_prefers_the_steps_counts_to_the_allocations() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}
    assert task_place(env) == TaskPlace(rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert task_place({"RANK": "0"}) is None  # no srun task
    with pytest.raises(KeyError):
        task_place({"SLURM_PROCID": "0"})  # no task count at all: read_identity says which launcher's


class _Srun:
    """A stand-in srun process that records what it is asked and never ends on its own (or
    ends at the signal named in ``ends_on``)."""

    def __init__(self, ends_on: str | None) -> None:
        self.ends_on, self.calls, self.code = ends_on, [], None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        self.calls.append(("wait", timeout))
        if self.code is None and timeout is not None:
            raise subprocess.TimeoutExpired("srun", timeout)
        return self.code if self.code is not None else 0

    def terminate(self) -> None:
        self.calls.append("SIGTERM")
        self.code = -15 if self.ends_on == "SIGTERM" else None

    def kill(self) -> None:
        self.calls.append("SIGKILL")
        self.code = -9


class _Slurm:
    """Slurm's client tools as this test says they answer: records each command (and the
    environment it ran with) instead of running it."""

    def __init__(self, squeue: str = "", fail: str | None = None) -> None:
        self.squeue, self.fail, self.commands, self.envs = squeue, fail, [], []

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.commands.append([os.path.basename(argv[0]), *argv[1:]])
        self.envs.append(kwargs.get("env"))
        tool = os.path.basename(argv[0])
        if tool == self.fail:
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified")
        return subprocess.CompletedProcess(argv, 0, self.squeue if tool == "squeue" else "", "")


def _step(process: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, slurm: _Slurm,
          env: dict[str, str] | None = None) -> SrunStep:
    monkeypatch.setattr(srun_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(srun_mod.subprocess, "run", slurm.run)
    return SrunStep(process, "clorch-j1", "j1", str(tmp_path / "srun.log"), env={"PATH": "/bin", **(env or {})})


def test_a_step_that_obeys_sigterm_is_not_killed(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    slurm = _Slurm()
    process = _Srun(ends_on="SIGTERM")
    _step(process, monkeypatch, tmp_path, slurm).end(exit_wait_s=1.5, term_wait_s=7.0)
    assert process.calls == [("wait", 1.5), "SIGTERM", ("wait", 7.0)]
    assert slurm.commands == []


def test_a_killed_sruns_step_in_an_allocation_is_cancelled_by_its_id(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any) -> None:
    """Under salloc or sbatch, srun's --job-name names the step, and scancel --name matches job names
    only: the backstop after a SIGKILLed srun once cancelled nothing exactly where batch jobs run.
    The step is found by its name in the allocation and cancelled by its id (the same on the real
    cluster: tests/integration/test_srun_step.py)."""
    slurm = _Slurm(squeue="7.0 clorch-other\n7.3 clorch-j1\n7.4 clorch-j1x\n")
    process = _Srun(ends_on=None)
    _step(process, monkeypatch, tmp_path, slurm, env={"SLURM_JOB_ID": "7"}).end(term_wait_s=5.0)
    assert process.calls == ["SIGTERM", ("wait", 5.0), "SIGKILL", ("wait", None)]
    assert slurm.commands == [["squeue", "--steps", "-j", "7", "-h", "-o", "%i %j"], ["scancel", "7.3"]]
    assert all(env is not None and env["SLURM_JOB_ID"] == "7" for env in slurm.envs)  # srun's cluster


def test_a_killed_sruns_own_job_is_cancelled_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    slurm = _Slurm()
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _step(_Srun(ends_on=None), monkeypatch, tmp_path, slurm).end(term_wait_s=5.0)
    assert slurm.commands == [["scancel", "--name=clorch-j1"]]


def test_a_step_already_gone_is_not_cancelled(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                              caplog: pytest.LogCaptureFixture) -> None:
    slurm = _Slurm(squeue="7.0 clorch-other\n")
    with caplog.at_level(logging.INFO, logger=srun_mod.__name__):
        _step(_Srun(None), monkeypatch, tmp_path, slurm, env={"SLURM_JOB_ID": "7"}).cancel()
    assert [c[0] for c in slurm.commands] == ["squeue"]
    assert "j1: step clorch-j1 of allocation 7 is already gone" in caplog.text


def test_a_failed_squeue_says_what_to_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                            caplog: pytest.LogCaptureFixture) -> None:
    slurm = _Slurm(fail="squeue")
    _step(_Srun(None), monkeypatch, tmp_path, slurm, env={"SLURM_JOBID": "9"}).cancel()
    assert [c[0] for c in slurm.commands] == ["squeue"]
    assert "j1: squeue --steps -j 9 -h -o %i %j exited 1 (slurm_load_jobs error: Invalid job id specified); " \
           "check squeue --steps -j 9 for a step named clorch-j1 and scancel JOBID.STEPID" in caplog.text


def test_cancel_without_scancel_says_what_to_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(srun_mod.shutil, "which", lambda name: None)
    SrunStep(_Srun(None), "clorch-j2", "j2", str(tmp_path / "srun.log"), env={}).cancel()
    assert "j2: no scancel on PATH to cancel srun's step; check squeue for a job named clorch-j2 and scancel it" \
        in caplog.text


@pytest.mark.parametrize("env, allocation", [({}, None), ({"SLURM_JOB_ID": "12"}, "12"), ({"SLURM_JOBID": "5"}, "5"),
                                             ({"SLURM_JOB_ID": ""}, None)])
def test_an_allocation_is_read_from_sruns_environment(env: dict[str, str], allocation: str | None) -> None:
    assert srun_mod.allocation_of(env) == allocation


def test_steps_are_matched_by_their_whole_name() -> None:
    lines = "3.0 clorch-a\n3.1 clorch-ab\n3.2 clorch-a\n\n3.extern extern\n"
    assert srun_mod.step_ids(lines, "clorch-a") == ["3.0", "3.2"]
    assert srun_mod.step_ids("", "clorch-a") == []


def test_what_srun_said_is_its_logs_last_lines(tmp_path: Any) -> None:
    step = SrunStep(_Srun(None), "clorch-j3", "j3", str(tmp_path / "srun.log"))
    assert step.said() == ""  # srun never ran: no log
    (tmp_path / "srun.log").write_text("".join(f"line {i}\n" for i in range(30)))
    assert step.said(3) == "line 27\nline 28\nline 29"
    assert step.said().splitlines()[0] == "line 10"  # SAID_LINES


def test_ranks_on_nodes_have_no_device_here_and_a_checked_backend() -> None:
    topo = nodes_topology(2, 3, None, None)
    assert (topo.nproc, topo.devices, topo.backend, topo.timeout_s) == (6, (None,) * 6, "", 600.0)
    assert nodes_topology(1, 2, "GLOO", "30", default_backend="nccl").backend == "gloo"
    assert nodes_topology(1, 2, None, None, default_backend="gloo").backend == "gloo"
    with pytest.raises(ConfigError, match="backend must be one of nccl, gloo; got 'mpi'"):
        nodes_topology(1, 1, "mpi", None)
    with pytest.raises(ConfigError, match="pg_timeout_s must be a positive number of seconds"):
        nodes_topology(1, 1, None, -1, timeout_name="pg_timeout_s")


def test_a_local_rank_meets_its_group_over_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    topo = Topology(nproc=2, devices=(0, 1), backend="nccl", timeout_s=60.0)
    place = local_place(topo, 1, master_port=2345, store_file="/d/store")
    assert (place.rank, place.local_rank, place.world_size, place.local_world_size) == (1, 1, 2, 2)
    assert (place.master_addr, place.master_port, place.socket_ifname, place.store_file) == (
        "127.0.0.1", 2345, "lo", "/d/store")
    assert (place.gpu, place.host_gpus, place.timeout_s) == ("5", ("4", "5"), 60.0)
    own = local_place(topo, 0, master_port=1, store_file="/s", timeout_s=9.0, host_gpus=False)
    assert (own.gpu, own.host_gpus, own.timeout_s) == ("4", (), 9.0)
    cpu = local_place(Topology(nproc=2, devices=(None, None), backend="gloo", timeout_s=1.0), 0, master_port=1,
                      store_file="/s")
    assert (cpu.gpu, cpu.host_gpus) == (None, ())


def test_a_stop_names_what_outlived_it_where_and_what_to_do() -> None:
    assert teardown.outlived([], timeout_s=0.01) == []
    me = os.getpid()  # a process that is certainly running, and no child of the test
    [line] = teardown.outlived([me, me], timeout_s=0.01)
    assert line == teardown.outlived_line(me, psutil.Process(me).name(), socket.gethostname())
    assert teardown.outlived_line(42, "python3", "node7") == (
        "process 42 (python3) on node7 was sent SIGKILL and is still there: check it with "
        "`ps -p 42 -o pid,stat,cmd` on node7 and, if it is still there, end it with `kill -9 42` (state D: it "
        "waits on the kernel, a GPU driver or a filesystem, and goes when that returns)")
    assert teardown.outlived_line(42, None, "node7").startswith("process 42 on node7 was sent SIGKILL")


def test_every_stop_shares_one_deadline_after_the_supervisors_grace() -> None:
    before = time.monotonic()
    at = teardown.deadline(5.0)
    assert before + 5.0 + teardown.KILL_MARGIN_S <= at <= time.monotonic() + 5.0 + teardown.KILL_MARGIN_S
