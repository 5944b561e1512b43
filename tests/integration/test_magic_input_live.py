"""Mistakes around a started session: a second %clorch start, logs of a missing rank, status
without ranks, and unloading the extension stopping the ranks. The refusals before any rank is
started: tests/unit/test_magic_input.py (whose helpers these tests share)."""

from __future__ import annotations

from typing import Any

from test_magic_input import no_session, say  # noqa: F401  (no_session: a fixture)


#: what these tests start: two CPU ranks, also on a machine with GPUs (where a bare
#: ``%clorch start`` would start one NCCL rank per GPU)
CPU_START = "start --nproc 2 --backend gloo"


def test_start_twice_and_logs_of_a_missing_rank_are_refused(ip: Any, magics: Any) -> None:
    if magics.session is None or not magics.session.running:
        ip.run_line_magic("clorch", CPU_START)
    try:
        for line, message in [("%clorch start", "2 gloo rank(s) are already running"),
                              ("%clorch logs 5", "logs names rank 5, which does not exist (0-1)"),
                              ("%clorch logs -1", "rank numbers start at 0"),
                              ("%clorch logs 0,1", "argument rank: one rank number, e.g. 0; got '0,1' (one rank "
                                                   "at a time: a list or a range names several)"),
                              ("%clorch logs x", "argument rank: one rank number, e.g. 0; got 'x'"),
                              ("%clorch logs --tail 5", "the following arguments are required: rank"),
                              ("%clorch logs 0 --tail -2", "--tail must be 0 (everything) or more")]:
            result, out = say(ip, line)
            assert not result.success and message in " ".join(out.split()), (line, out)  # (wrapped to the width)
            assert "Traceback" not in out
    finally:
        magics.shutdown()


def test_status_without_ranks_answers_and_does_not_fail(no_session: Any) -> None:
    """A question, not a failed command: Run All goes on past it before a start or after a stop."""
    result, out = say(no_session, "%clorch status")
    assert result.success, out
    assert out.strip() == "clorch: no ranks are running; %clorch start starts them"


def test_unloading_the_extension_stops_the_ranks(ip: Any, magics: Any, monkeypatch: Any) -> None:
    import shutil

    from clorch_repl.common.procs import wait_gone

    monkeypatch.setenv("CLORCH_KEEP_LOGS", "1")  # (the suite's default: none kept)
    ip.run_line_magic("clorch", CPU_START)
    assert ip.run_cell("%%distributed\nprint('before the unload', rank)").success
    pids = magics.session.pids()
    result, said = say(ip, "%unload_ext clorch_repl")
    assert wait_gone(pids, 10) == []
    kept = said.rsplit("their logs are kept in ", 1)[1].strip()
    try:
        result, out = say(ip, "%clorch status")
        assert not result.success and "Line magic function `%clorch` not found" in out  # gone with the extension
        ip.run_line_magic("load_ext", "clorch_repl")
        result, out = say(ip, "%clorch status")
        assert "no ranks are running" in out  # loaded again, clean
        result, out = say(ip, "%clorch logs 0")  # what the unload's stop kept, as after %clorch stop
        assert result.success and "before the unload 0" in out.splitlines(), out
        assert out.startswith(f"clorch: no ranks are running; rank 0's log as the last %clorch stop kept it ({kept}")
    finally:
        shutil.rmtree(kept, ignore_errors=True)
