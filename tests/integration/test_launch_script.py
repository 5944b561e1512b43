"""``dist.launch(script=..., args=[...])`` and ``module=`` (issue 35): a torchrun script as a batch
job, on real ranks, giving what real torchrun gives; its own init_process_group() accepted and its
destroy_process_group() keeping the job's group, as under ``%clorch run``; a failing script named
from its own frames. Refusals before any process starts are at the end."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from clorch_repl import distributed as dist
from clorch_repl.errors import ConfigError, RankFailure

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_scripts")
ROOT = os.path.dirname(os.path.dirname(SCRIPTS))


def rank_lines(job: dist.Job, rank: int, start: str) -> list[str]:
    return [line for line in job.logs(rank).splitlines() if line.startswith(start)]


def test_a_script_job_runs_the_ddp_tutorial_as_torchrun_does() -> None:
    from test_torch_code import torchrun

    expected = torchrun("ddp_tutorial.py", "3")
    job = dist.launch(nproc_per_node=2, script=os.path.join(SCRIPTS, "ddp_tutorial.py"), args=["3"],
                      timeout_ms=120_000)
    assert job.wait() == [None, None]
    assert {r: rank_lines(job, r, "rank ") for r in (0, 1)} == expected
    assert job.status().main == "script ddp_tutorial.py"
    # the tutorial's destroy_process_group(): a job has no cells to keep the group for
    for r in (0, 1):
        assert rank_lines(job, r, "clorch: destroy_process_group()") == [
            "clorch: destroy_process_group() kept the job's gloo group: it ends with the job"], job.logs(r)


def test_a_module_job_sees_torchruns_variables_and_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # -m finds tests.torchrun_scripts from the working directory, as python -m does
    job = dist.launch(nproc_per_node=2, module="tests.torchrun_scripts.report", args=["a", "--b", "2"],
                      timeout_ms=120_000)
    job.wait()
    for r in (0, 1):
        assert rank_lines(job, r, "name") == ["name __main__"]
        assert rank_lines(job, r, "argv") == ["argv report.py a --b 2"]
        assert rank_lines(job, r, "env") == [
            f"env RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=1 "
            f"ROLE_RANK={r} ROLE_WORLD_SIZE=2 TORCHELASTIC_RUN_ID=clorch"]


def test_a_failing_script_is_named_from_its_own_frames() -> None:
    job = dist.launch(nproc_per_node=2, script=os.path.join(SCRIPTS, "exits.py"), args=["raise", "1"],
                      timeout_ms=120_000)
    with pytest.raises(RankFailure) as info:
        job.wait()
    text = str(info.value)
    assert "rank 1 failed first" in text and "ValueError: bad value on rank 1" in text, text
    shown = info.value.traceback_text  # type: ignore[attr-defined]
    assert "exits.py" in shown and "runpy" not in shown and "_script_entry" not in shown, shown
    clean = dist.launch(nproc_per_node=2, script=os.path.join(SCRIPTS, "exits.py"), args=["0"], timeout_ms=120_000)
    assert clean.wait() == [None, None]  # sys.exit(0) ends a script cleanly, as under python


def test_a_scripts_sys_exit_is_its_status_and_line_after_what_it_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse's refusal, as %clorch run shows it: argparse's usage and error (the rank's log's
    last lines), then the one line naming the status and the script's line; not the SystemExit's
    traceback through argparse's frames. The rank exits with the script's status, as under python."""
    job = dist.launch(nproc_per_node=2, script=os.path.join(SCRIPTS, "ddp_resume.py"),
                      args=["--epochs", "x", "--snapshot", "/nowhere"], timeout_ms=120_000)
    with pytest.raises(RankFailure) as info:
        job.wait()
    text = str(info.value)
    head, _, body = text.partition("\n")
    assert re.fullmatch(r"rank [01] failed first in job-\d+ \(script ddp_resume.py\): ScriptExit: ddp_resume.py "
                        r"exited with status 2 \(sys.exit at ddp_resume.py:30\)", head), text
    assert "usage: ddp_resume.py" in body and \
        "ddp_resume.py: error: argument --epochs: invalid int value: 'x'" in body, text
    assert "Traceback" not in text and "argparse.py" not in text and "SystemExit" not in text, text
    for r in (0, 1):
        assert "ddp_resume.py: error: argument --epochs: invalid int value: 'x'" in job.logs(r), job.logs(r)
    status = job.status()  # (the other rank may have been stopped by the job as it ended: its status is the stop's)
    assert status.ranks[status.first_failed_rank].exit_code == 2, status
    # a module's sys.exit with a message: the message printed (into the log), status 1, the module's line
    monkeypatch.chdir(ROOT)
    job = dist.launch(nproc_per_node=2, module="tests.torchrun_scripts.exits", args=["msg", "1"], timeout_ms=120_000)
    with pytest.raises(RankFailure) as info:
        job.wait()
    text = str(info.value)
    assert text.startswith(f"rank 1 failed first in {job.id} (module tests.torchrun_scripts.exits): ScriptExit: "
                           "tests.torchrun_scripts.exits exited with status 1 (sys.exit at exits.py:23)\n"), text
    assert "cannot go on: no data" in text and "Traceback" not in text, text
    assert job.status().ranks[1].exit_code == 1, job.status()


@pytest.mark.parametrize("kwargs, words", [
    ({"script": "no/such/train.py"}, "script: no file 'no/such/train.py' on host "),
    ({"module": "no_such_module_xyz"}, "module: no module 'no_such_module_xyz' on host "),
    ({"script": os.path.join(SCRIPTS, "report.py"), "main": "os:getcwd"}, "got main and script"),
    ({}, "launch needs one of main ('module:function'), script ('train.py') or module"),
    ({"script": os.path.join(SCRIPTS, "report.py"), "args": "--epochs 2"}, "a list of strings"),
    ({"script": os.path.join(SCRIPTS, "report.py"), "args": ["--epochs", 2]}, "a list of strings"),
])
def test_what_to_run_is_checked_before_any_process_starts(kwargs: dict[str, Any], words: str) -> None:
    before = len(dist.jobs())
    with pytest.raises(ConfigError, match=re.escape(words)):
        dist.launch(nproc_per_node=2, **kwargs)
    assert len(dist.jobs()) == before
