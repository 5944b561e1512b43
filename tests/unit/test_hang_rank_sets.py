"""The hang verdicts and ``%clorch why`` name every rank, each set of ranks once: a mismatched
collective groups ranks by what they called, ranks whose phrase is the same share one clause
(``ranks 0-2 are not running a cell``), and no stack shows clorch_repl's own frames, in the
all-threads view either.

Fast: rank answers shaped as gloo ranks give them (the entries' fields as torch's flight recorder
writes them, the stacks as :func:`clorch_repl.diagnosis.probe.answer` builds them); one test asks
this process itself. On real ranks: tests/integration/test_hang_analysis_live.py.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from clorch_repl.diagnosis import analyse as analysis, probe, render
from clorch_repl.diagnosis.analyse import RankEvidence, analyse
from clorch_repl.diagnosis.entries import Entry
from clorch_repl.diagnosis.where import where
from clorch_repl.wire.probe import ProbeRequest

SITE = "/work/.venv/lib/python3.11/site-packages"
PKG = os.path.dirname(os.path.abspath(probe.__file__ + "/.."))


def _entry(seq: int, op: str, state: str, size: int = 4) -> dict[str, Any]:
    """One gloo entry of the default group (torch 2.11's field names)."""
    sizes = [[size]] if op != "barrier" else []
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": sizes,
            "input_dtypes": ["Float"] * len(sizes), "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes),
            "state": state, "retired": False, "is_p2p": False, "time_created_ns": 1_000_000_000 * seq}


def _cell(line: int, code: str) -> dict[str, Any]:
    return {"file": "/tmp/ipykernel_1/3.py", "cell": "Cell In[3]", "line": line, "function": "<module>",
            "code": code, "library": False, "own": False}


def _answer(entries: list[dict[str, Any]], world: int, *, in_cell: bool = True,
            stack: list[dict[str, Any]] | None = None, **more: Any) -> dict[str, Any]:
    return {"fr": {"entries": entries, "pg_status": {"0": {"last_completed_collective": 1}}},
            "groups": {"0": {"ranks": list(range(world)), "default": True}}, "stack": stack or [],
            "in_cell": in_cell, "now_ns": 10**10, **more}


def _idle(rank: int, world: int, host: str = "") -> RankEvidence:
    return RankEvidence(rank, answer=_answer([_entry(1, "barrier", "completed")], world, in_cell=False), host=host)


# ------------------------------------------------------------ defect 1: a third rank's call
def test_a_mismatch_of_three_ranks_names_every_ranks_call() -> None:
    # %%distributed with 3 ranks: rank 0 broadcasts, ranks 1 and 2 all_reduce (collective #2).
    # Before: "rank 0 called broadcast(float32[4]), rank 1 called all_reduce(float32[4])".
    states = [RankEvidence(r, answer=_answer([_entry(1, "barrier", "completed"),
                                              _entry(2, "broadcast" if r == 0 else "all_reduce", "scheduled")], 3,
                                             stack=[_cell(3, "dist.all_reduce(t)")]))
              for r in range(3)]
    verdict = analyse(states)
    assert verdict.stuck and verdict.mismatch and verdict.seq == 2
    assert verdict.sentence == ("collective #2 (default group): rank 0 called broadcast(float32[4]), "
                                "ranks 1-2 called all_reduce(float32[4]); ranks 0-2 wait in it")


def test_a_size_mismatch_groups_the_ranks_by_what_they_passed() -> None:
    states = [RankEvidence(r, answer=_answer([_entry(1, "barrier", "completed"),
                                              _entry(2, "all_reduce", "scheduled", 8 if r == 1 else 4)], 3))
              for r in range(3)]
    assert analyse(states).sentence == ("all_reduce #2 (float32[4], default group): ranks 0,2 passed float32[4], "
                                        "rank 1 passed float32[8]; ranks 0-2 wait in it")


def test_ranks_are_grouped_by_what_they_called() -> None:
    def entry(rank: int, op: str) -> Entry:
        return Entry(rank, "0", 2, op, _entry(2, op, "scheduled"), False)

    present = {0: entry(0, "broadcast"), 1: entry(1, "all_reduce"), 2: entry(2, "all_reduce"), 3: entry(3, "broadcast")}
    groups = analysis.alike(present, lambda a, b: a.op == b.op)
    assert groups == [[0, 3], [1, 2]]
    assert analysis.mismatch_text([(g, present[g[0]]) for g in groups]) == (
        "ranks 0,3 called broadcast(float32[4]), ranks 1-2 called all_reduce(float32[4])")


# ---------------------------------------------------- defect 2: identical lines, said once
def test_ranks_not_running_a_cell_are_one_clause() -> None:
    # Before: "rank 0 is not running a cell; rank 1 is not running a cell; rank 2 is not running a cell".
    verdict = analyse([_idle(r, 3) for r in range(3)])
    assert verdict.sentence == "no collective is pending: ranks 0-2 are not running a cell"


def test_the_rank_that_differs_keeps_its_own_clause() -> None:
    states = [_idle(0, 3), RankEvidence(1, answer=_answer([_entry(1, "barrier", "completed")], 3,
                                                          stack=[_cell(4, "time.sleep(60)")])), _idle(2, 3)]
    assert analyse(states).sentence == ("no collective is pending: ranks 0,2 are not running a cell; "
                                        "rank 1 is at Cell In[3], line 4 in <module>")


def test_ranks_that_never_called_a_pending_collective_are_one_clause() -> None:
    waiting = RankEvidence(0, answer=_answer([_entry(1, "barrier", "completed"), _entry(2, "all_reduce", "scheduled")],
                                             4, stack=[_cell(3, "dist.all_reduce(t)")]))
    verdict = analyse([waiting, *(_idle(r, 4) for r in range(1, 4))])
    assert verdict.sentence == ("all_reduce #2 (float32[4], default group): rank 0 waits in it; "
                                "ranks 1-3 never called it and are not running a cell")
    assert verdict.missing == [1, 2, 3]


def test_ranks_of_different_hosts_are_not_merged() -> None:
    states = [_idle(0, 3, "hostA"), _idle(1, 3, "hostA"), _idle(2, 3, "hostB")]
    assert analyse(states).sentence == ("no collective is pending: ranks 0-1 on hostA are not running a cell; "
                                        "rank 2 on hostB is not running a cell")


def test_dead_ranks_with_the_same_cause_are_one_clause() -> None:
    states = [_idle(0, 3), RankEvidence(1, dead="exit code 3"), RankEvidence(2, dead="exit code 3")]
    assert analyse(states).sentence.startswith("ranks 1-2 died (exit code 3); ")


def test_every_phrase_has_its_plural() -> None:
    busy = RankEvidence(0, answer=_answer([], 2, stack=[_cell(5, "x.sum().item()")], cuda_busy=True))
    silent = RankEvidence(0, answer=None,
                          fallback_stack='  File "Cell In[7]", line 3 in <module>\n')
    prompt = RankEvidence(0, answer=_answer([], 2, stack=[_cell(2, "input('go? ')")]), prompt="go? ")
    library = RankEvidence(0, answer=_answer([], 2, stack=[{"file": f"{SITE}/IPython/x.py", "line": 1,
                                                            "function": "f", "library": True}]))
    assert analysis.by_phrase([busy, RankEvidence(1, answer=busy.answer)], lambda s, many: where(s, many=many)) == [
        "ranks 0-1 are at Cell In[3], line 5 in <module>, with their CUDA streams still busy"]
    assert where(silent, many=True) == ("did not answer (native code is holding their Python locks); "
                                        "they are at Cell In[7], line 3 in <module>")
    idle = RankEvidence(0, answer=None, fallback_stack=(
        '  File "/usr/lib/python3.11/selectors.py", line 468 in select\n'
        '  File "/usr/lib/python3.11/asyncio/base_events.py", line 1884 in _run_once\n'))
    # its stack shows it waiting for a request: a probe unanswered on a busy host (a try-out's verdict
    # blamed a held Python lock, which select() releases)
    assert where(idle) == ("did not answer in time, though its stack shows it idle, waiting for a request (not "
                           "running a cell): a busy host, not a held Python lock")
    assert "their stacks show them idle" in where(idle, many=True)
    assert where(prompt, many=True) == ("are waiting for input at Cell In[3], line 2 in <module> "
                                        "(their prompts 'go? ' wait for your answers in the notebook)")
    assert where(library, many=True) == "are in library code outside their cells' lines (IPython/x.py:1 in f())"
    assert where(library) == "is in library code outside its cell's lines (IPython/x.py:1 in f())"
    writing = RankEvidence(0, answer={"in_cell": True, "stack": [
        {"file": "/x/site-packages/IPython/core/interactiveshell.py", "line": 2279, "function": "showtraceback",
         "library": True}, {"file": "/x/site-packages/pygments/lexer.py", "line": 1, "function": "f", "library": True}]})
    assert where(writing) == "has raised an error in its cell (IPython is writing its traceback)"
    assert where(writing, many=True) == "have raised an error in their cells (IPython is writing their tracebacks)"


# ----------------------------------------------- defect 3: clorch's frames in every thread
def test_a_threads_clorch_frames_are_left_out_and_clorch_threads_are_one_line() -> None:
    boot = {"file": "/usr/lib/python3.11/threading.py", "line": 1002, "function": "_bootstrap",
            "code": "self._bootstrap_inner()", "library": True, "own": False}
    mine = {"file": f"{PKG}/diagnosis/probe.py", "line": 68, "function": "answer",
            "code": "frames = sys._current_frames()", "library": True, "own": True}
    user = {"file": "/home/u/loader.py", "line": 12, "function": "fill", "code": "q.put(batch)",
            "library": False, "own": False}
    torch_wait = {"file": f"{SITE}/torch/distributed/distributed_c10d.py", "line": 3252,
                  "function": "all_reduce", "code": "work.wait()", "library": True, "own": False}
    answer = _answer([], 1, in_cell=False, threads=[
        {"name": "Control", "stack": [boot, mine]},
        {"name": "loader", "stack": [boot, user, mine]},  # a user's thread through a clorch call
        {"name": "saver", "stack": [boot, mine, torch_wait]}])
    text = "\n".join(render.evidence([RankEvidence(0, answer=answer)], all_threads=True))
    assert "probe.py" not in text and "answer()" not in text, text
    assert "  thread Control: clorch_repl's own work (its frames not shown)" in text
    assert "  thread loader:\n" in text and "/home/u/loader.py:12 in fill()" in text
    assert ("  thread saver: clorch_repl's own work (its frames not shown), now at "
            "torch/distributed/distributed_c10d.py:3252 in all_reduce()") in text


def test_the_rank_marks_its_own_frames_by_their_file() -> None:
    assert probe.is_own(probe.__file__) and probe.is_own(os.path.join(PKG, "common", "procs.py"))
    assert not probe.is_own(threading.__file__) and not probe.is_own("<frozen runpy>")
    assert not probe.is_own(PKG + "_other/x.py")  # a folder that only starts like the package's


def test_all_threads_of_this_process_show_no_clorch_frame() -> None:
    # A thread of clorch's own (its target in clorch_repl/common/procs.py) and one of the user's,
    # asked as %clorch why --all-threads asks a rank: before, probe.py's and procs.py's frames showed.
    from clorch_repl.common import procs

    stop = threading.Event()

    def users_loop() -> None:
        stop.wait(10)

    threads = [threading.Thread(target=procs._wait_for_an_exit, args=([os.getpid()], 3.0), name="clorch-watch"),
               threading.Thread(target=users_loop, name="users-loop")]
    for thread in threads:
        thread.daemon = True
        thread.start()
    try:
        time.sleep(0.2)
        answer = probe.answer(ProbeRequest(all_threads=True))
    finally:
        stop.set()
    text = "\n".join(render.evidence([RankEvidence(0, answer=answer)], all_threads=True))
    assert "clorch_repl/" not in text and "clorch_repl" + os.sep not in text, text
    assert "thread clorch-watch: clorch_repl's own work" in text, text
    assert "in users_loop()" in text, text


def test_a_requests_cell_is_no_line_of_the_users(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # %clorch run's hang report showed rank 0 at "Cell In[7], line 1 in <module>" and the request's
    # text (__import__('clorch_repl.kernel.requests', ...).call('script_run', ...)) above the
    # script's own frames. Here a request's cell, compiled as ipykernel compiles a cell (a file of
    # its own), runs on a thread and waits in its handler, as a script waits in a collective.
    from clorch_repl.kernel import requests
    from clorch_repl.wire.requests import request_code

    started, stop = threading.Event(), threading.Event()

    def users_script() -> None:  # what the request runs: the user's code, waiting
        started.set()
        stop.wait(10)

    monkeypatch.setitem(requests.HANDLERS, "hold", "unused:unused")
    monkeypatch.setitem(requests._resolved, "hold", users_script)
    cell_file = str(tmp_path / "2255580287.py")
    code = compile(request_code("hold"), cell_file, "exec")
    thread = threading.Thread(target=exec, args=(code, {}), name="request", daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        answer = probe.answer(ProbeRequest(all_threads=True))
    finally:
        stop.set()
        thread.join(10)
    stack = next(t["stack"] for t in answer["threads"] if t["name"] == "request")
    cell = next(f for f in stack if f["file"] == cell_file)
    assert cell["own"] and cell["library"], cell  # the rank knows it ran a request there
    text = "\n".join(render.evidence([RankEvidence(0, answer=answer)], all_threads=True))
    assert "in users_script()" in text, text
    assert cell_file not in text and "clorch_repl.kernel.requests" not in text and "'hold'" not in text, text
    assert not probe.is_own(str(tmp_path / "another_cell.py"))  # a cell of the user's stays the user's


# ------------------------------------- noticed on the way: a collective a dead peer ended
def test_the_last_collective_beside_a_dead_peer_is_not_called_completed() -> None:
    # As a gloo rank answered (torch 2.13) after its all_reduce failed on the peer's death: the
    # recorder retires the failed entry as it does a finished one (state "scheduled", retired,
    # the group's status counting it completed).
    entries = [dict(_entry(1, "barrier", "scheduled"), retired=True), dict(_entry(2, "all_reduce", "scheduled", 8),
                                                                          retired=True)]
    answer = _answer(entries, 2, in_cell=False)
    answer["fr"]["pg_status"] = {"0": {"last_enqueued_collective": 2, "last_completed_collective": 2}}
    states = [RankEvidence(0, answer=answer), RankEvidence(1, dead="exit code 3")]
    text = render.report(analyse(states), states).splitlines()
    assert text[0] == ("rank 1 died (exit code 3); the last collective of rank 0 was all_reduce #2 "
                       "(float32[8], default group)")
    assert "    barrier #1 (no tensor) group 0: completed" in text
    assert "    all_reduce #2 (float32[8]) group 0: ended, perhaps failed (rank 1 of its group died)" in text
    alive = [RankEvidence(0, answer=answer), _idle(1, 2)]
    assert "    all_reduce #2 (float32[8]) group 0: completed" in render.report(analyse(alive), alive).splitlines()


def test_a_death_report_blames_no_collective_from_before_the_cell() -> None:
    """A try-out: rank 1 died while rank 0 only slept; the report said "the last collective of rank
    0 was barrier #1" and "barrier #1 ... ended, perhaps failed (rank 1 of its group died)": the
    session's start-up barrier, completed long before the cell. A rank says when its cell began
    (``cell_began_ns``, the recorder's clock), and what came before it is not the cell's."""
    entries = [dict(_entry(1, "barrier", "completed"), retired=True)]  # created at 1 s
    answer = _answer(entries, 2, cell_began_ns=5 * 10**9)
    states = [RankEvidence(0, answer=answer), RankEvidence(1, dead="exit code 3")]
    text = render.report(analyse(states), states).splitlines()
    assert text[0] == "rank 1 died (exit code 3); rank 0 had entered no collective in this cell", text
    assert "    barrier #1 (no tensor) group 0: completed" in text, text
    # a collective of the cell is still named, and its state doubted
    entries.append(dict(_entry(2, "all_reduce", "scheduled", 8), retired=True))  # created at 2 s
    answer = _answer(entries, 2, cell_began_ns=int(1.5 * 10**9))
    answer["fr"]["pg_status"] = {"0": {"last_enqueued_collective": 2, "last_completed_collective": 2}}
    states = [RankEvidence(0, answer=answer), RankEvidence(1, dead="exit code 3")]
    text = render.report(analyse(states), states).splitlines()
    assert text[0].startswith("rank 1 died (exit code 3); the last collective of rank 0 was all_reduce #2"), text
    assert "    all_reduce #2 (float32[8]) group 0: ended, perhaps failed (rank 1 of its group died)" in text, text
