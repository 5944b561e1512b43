"""A user try-out of batch jobs and logs, on the parts that need no process: a job's ranks are a
stand-in that starts nothing (the job's own bookkeeping is real). ``job.wait(timeout)`` running
out is a ClorchError that is also a TimeoutError, shown from the user's line; a Ctrl-C in the
wait stays a plain KeyboardInterrupt; a rank that failed without writing a line says its log is
empty; ``%clorch logs N`` reads the logs the last stop kept; "held back 1 line". The same with
real ranks and a real session: tests/integration/test_jobs_logs_tryout.py."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl.common.topology import nodes_topology
from clorch_repl.errors import ClorchError, JobStillRunning, RankFailure
from clorch_repl.host.logfiles import without_ansi
from clorch_repl.jobs.batch import Job
from clorch_repl.jobs.job_ranks import JobPlan, JobRanks


class _NoRanks(JobRanks):
    """Ranks that never start: the test reports their ends itself."""

    name = "none"

    @classmethod
    def topology(cls, *args: Any) -> Any:
        raise NotImplementedError

    def start(self) -> None:
        pass

    def stop(self, ranks: list[int], grace_s: float, wait: bool) -> None:
        pass


def _job(tmp_path: Any, main: str = "myjobs:crash") -> Job:
    plan = JobPlan(job_id="job-4", directory=str(tmp_path), spec_path=str(tmp_path / "job.json"),
                   topology=nodes_topology(1, 2, "gloo", None), base_env={}, extra_env={}, pg_timeout_s=600.0,
                   timeout_s=None, grace_s=1.0, owns_dir=False)
    return Job(plan, main, _NoRanks)


def _shown(ip: Any, job: Job, code: str) -> str:
    ip.user_ns["job"] = job
    with capture_output() as cap:
        ip.run_cell(code)
    return without_ansi(cap.stdout + cap.stderr)


def test_a_wait_that_runs_out_is_a_timeout_error_shown_from_the_users_line(ip: Any, tmp_path: Any) -> None:
    job = _job(tmp_path)
    with pytest.raises(TimeoutError) as info:
        job.wait(timeout=0.01)
    assert isinstance(info.value, JobStillRunning) and isinstance(info.value, ClorchError)
    assert str(info.value) == "job-4 is still running after 0.01 s; job.stop() ends it"
    out = _shown(ip, job, "job.wait(timeout=0.01)")
    assert "JobStillRunning" in out and "job.wait(timeout=0.01)" in out  # the user's line
    assert "clorch_repl/" not in out and "user_frames" not in out, out


def test_a_ctrl_c_in_the_wait_stays_a_plain_keyboard_interrupt(ip: Any, tmp_path: Any) -> None:
    """The interrupt lands on the lock the wait blocks on: it says nothing, the job running on does."""
    job = _job(tmp_path)
    main = threading.get_ident()
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            job.wait(timeout=30)
    finally:
        timer.cancel()
    assert type(info.value) is KeyboardInterrupt
    assert str(info.value) == "job-4 keeps running; job.wait() waits again, job.stop() ends it"
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        out = _shown(ip, job, "job.wait(timeout=30)")
    finally:
        timer.cancel()
    assert "KeyboardInterrupt: job-4 keeps running" in out, out
    assert "clorch_repl/" not in out and "threading.py" not in out, out


def test_a_rank_that_wrote_nothing_says_its_log_is_empty(tmp_path: Any) -> None:
    job = _job(tmp_path)
    open(job.log_path(0), "w").close()  # the rank's log: there, and empty (os._exit(7) before any print)
    job._stopping.add(1)
    job._rank_ended(0, 7)
    job._rank_ended(1, -signal.SIGTERM)
    job._monitor()  # returns once every rank has ended
    with pytest.raises(RankFailure) as info:
        job.wait()
    text = str(info.value)
    assert text.startswith("rank 0 failed first in job-4 (myjobs:crash): exit code 7\n"
                           "its log is empty: it wrote nothing\nRank 1 was stopped or failed after it."), text
    assert "last lines of its log" not in text


def test_the_last_lines_of_a_log_that_has_some_are_shown(tmp_path: Any) -> None:
    job = _job(tmp_path)
    with open(job.log_path(0), "w") as fh:
        fh.write("loading\nsegfault ahead\n")
    job._rank_ended(0, 7)
    job._rank_ended(1, 0)
    job._monitor()
    with pytest.raises(RankFailure, match="exit code 7\nlast lines of its log:\nloading\nsegfault ahead\n"):
        job.wait()


def test_logs_after_a_stop_read_the_folder_the_stop_kept(tmp_path: Any) -> None:
    from clorch_repl.magics.views import log_text

    kept = tmp_path / "clorch-abc123-logs"
    kept.mkdir()
    (kept / "rank0.log").write_text("--- clorch_repl: rank 0 starting ---\nhello from rank 0\n")
    (kept / "rank1.log").write_text("one\n")
    text = log_text(None, str(kept), 0, 200, None)
    assert text == (f"clorch: no ranks are running; rank 0's log as the last %clorch stop kept it "
                    f"({kept / 'rank0.log'}):\n--- clorch_repl: rank 0 starting ---\nhello from rank 0\n")
    with pytest.raises(ClorchError, match=f"no ranks are running, and {kept} holds no log of rank 5 "
                                          r"\(it has rank0.log, rank1.log\): run %clorch start first"):
        log_text(None, str(kept), 5, 200, None)
    with pytest.raises(ClorchError, match="^no ranks are running: run %clorch start first"):
        log_text(None, "", 0, 200, None)  # no stop kept any: as before


def test_logs_magic_after_a_stop_shows_the_kept_log(ip: Any, magics: Any, tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    magics.shutdown()
    kept = tmp_path / "clorch-xyz-logs"
    kept.mkdir()
    (kept / "rank0.log").write_text("\x1b[31mred\x1b[0m line\n")
    monkeypatch.setattr(magics, "kept_logs", str(kept), raising=False)
    with capture_output() as cap:
        ip.run_line_magic("clorch", "logs 0 --tail 5")
    assert cap.stdout == f"clorch: no ranks are running; rank 0's log as the last %clorch stop kept it " \
                         f"({os.path.join(kept, 'rank0.log')}):\nred line\n"


def test_held_back_says_one_line_not_one_lines() -> None:
    from clorch_repl.notebook.held_notice import HeldNotice
    from clorch_repl.wire.limits import Limits

    notice = HeldNotice(Limits())
    notice._page[0] = [1, 300_000]
    assert notice.text().startswith("clorch held back 1 line (293 KiB) of this cell's output"), notice.text()
    notice._page[0] = [2, 300_000]
    assert notice.text().startswith("clorch held back 2 lines (293 KiB)")
