"""A user try-out of batch jobs and logs, with real ranks (one job, one session): a wait that
runs out on a running job is a TimeoutError of clorch's own; a rank that ended with
``os._exit(7)`` before writing a line is reported with its log empty, not with an empty section;
``%clorch logs N`` after ``%clorch stop`` shows the log that the stop kept. The parts that need no
process: tests/unit/test_jobs_tryout.py."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl.common.procs import wait_gone

SILENT_CRASH = """\
import os, time
if os.environ["RANK"] == "0":
    time.sleep(1.0)
    os._exit(7)
time.sleep(120)
"""


def test_a_rank_that_exits_before_writing_a_line_is_reported_with_its_log_empty(tmp_path: Any) -> None:
    from clorch_repl import distributed as dist
    from clorch_repl.errors import JobStillRunning, RankFailure

    script = tmp_path / "silent_crash.py"
    script.write_text(SILENT_CRASH)
    job = dist.launch(nproc_per_node=2, script=str(script), timeout_ms=120_000)
    with pytest.raises(TimeoutError) as info:
        job.wait(timeout=0.2)  # the ranks are still importing torch
    assert isinstance(info.value, JobStillRunning)
    with pytest.raises(RankFailure) as failed:
        job.wait()
    text = str(failed.value)
    assert "rank 0 failed first" in text and "exit code 7" in text, text
    assert "its log is empty: it wrote nothing\nRank 1 was stopped or failed after it." in text, text
    assert "last lines of its log" not in text


def test_logs_after_a_stop_show_the_log_the_stop_kept(ip: Any, magics: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLORCH_KEEP_LOGS", "1")  # the suite removes them (tests/conftest.py)
    monkeypatch.setattr(magics, "kept_logs", "", raising=False)  # (as it was, after the test)
    if magics.session is not None and magics.session.running:
        magics.shutdown()
    ip.run_line_magic("clorch", "start --nproc 2")
    kept = ""
    try:
        result = ip.run_cell("%%distributed\nprint(f'tryout marker of rank {rank}')")
        assert result.success
        pids = magics.session.pids()
        with capture_output() as cap:
            ip.run_line_magic("clorch", "stop")
        assert wait_gone(pids, 10) == []
        kept = cap.stdout.rsplit("their logs are kept in ", 1)[1].strip()
        assert os.path.isfile(os.path.join(kept, "rank0.log")), cap.stdout
        with capture_output() as cap:
            ip.run_line_magic("clorch", "logs 0")
        first, *rest = cap.stdout.splitlines()
        assert first == (f"clorch: no ranks are running; rank 0's log as the last %clorch stop kept it "
                         f"({os.path.join(kept, 'rank0.log')}):")
        assert "tryout marker of rank 0" in rest and "tryout marker of rank 1" not in rest, cap.stdout
        with capture_output() as cap:
            result = ip.run_cell("%clorch logs 5")
        out = " ".join((cap.stdout + cap.stderr).split())  # (the refusal is wrapped at the cell's width)
        assert not result.success
        assert f"no ranks are running, and {kept} holds no log of rank 5 (it has rank0.log, rank1.log)" in out, out
    finally:
        magics.shutdown()
        if kept:
            shutil.rmtree(kept, ignore_errors=True)


def test_logs_after_a_failed_restart_show_the_log_its_stop_kept(ip: Any, magics: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A review's finding: a restart whose start fails stops the session (its logs kept), but
    ``%clorch logs N`` then said no ranks were running, naming no log. The start's failure is
    simulated (a raising ``start``): a real one (a group that cannot form) takes minutes to provoke;
    the stop before it and the stop after it are the real ones."""
    from clorch_repl.errors import ClorchError

    monkeypatch.setenv("CLORCH_KEEP_LOGS", "1")
    monkeypatch.setattr(magics, "kept_logs", "", raising=False)
    if magics.session is not None and magics.session.running:
        magics.shutdown()
    ip.run_line_magic("clorch", "start --nproc 2")
    session = magics.session
    try:
        assert ip.run_cell("%%distributed\nprint(f'before the restart, rank {rank}')").success

        def failing_start(progress: Any = None) -> float:
            raise ClorchError("simulated: the ranks could not form their process group")

        monkeypatch.setattr(session, "start", failing_start)
        with capture_output() as cap:
            result = ip.run_cell("%clorch restart")
        assert not result.success and "simulated" in cap.stdout + cap.stderr
        assert session.kept_logs and not session.running
        with capture_output() as cap:
            ip.run_line_magic("clorch", "logs 0")
        assert cap.stdout.startswith(f"clorch: no ranks are running; rank 0's log as the last %clorch stop kept it "
                                     f"({os.path.join(session.kept_logs, 'rank0.log')}):"), cap.stdout
        assert "before the restart, rank 0" in cap.stdout.splitlines(), cap.stdout
    finally:
        monkeypatch.undo()
        magics.shutdown()
        if session.kept_logs:
            shutil.rmtree(session.kept_logs, ignore_errors=True)
