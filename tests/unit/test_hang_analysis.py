"""The analysis on hand-written rank states and on NCCL answers recorded on GPUs (tests/gpu/recorded),
without processes. On answers recorded from real gloo ranks (tests/hang_scenarios.py):
tests/integration/test_hang_analysis_live.py."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from clorch_repl.diagnosis import render
from clorch_repl.diagnosis.analyse import RankEvidence, analyse


HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_full_ring_of_a_healthy_loop_is_no_hang() -> None:
    # The reviewer's cases: a status whose "last completed" lags (operations seen to finish out of
    # order, NCCL numbering sends apart) under a full ring that still holds the group's entries;
    # and a side group whose entries are all gone while the rank computes outside torch.distributed.
    entries = [nccl_entry(seq, "nccl:all_reduce", [[4]], "completed", 1.0) for seq in range(1, 2001)]
    answer = nccl_answer(entries, enqueued=6000, completed=3000, stack=[frame("/tmp/ipykernel_1/2.py", 4, "<module>",
                                                                              "Cell In[3]")])
    answer["fr"]["full"] = {"nccl": True}
    assert not analyse([RankEvidence(0, answer=answer), RankEvidence(1, answer=answer)]).hang
    answer["fr"]["pg_status"]["nccl/7"] = {"last_enqueued_collective": 6, "last_completed_collective": 5}
    assert not analyse([RankEvidence(0, answer=answer), RankEvidence(1, answer=answer)]).hang  # computing in the cell


def test_a_dead_rank_is_named() -> None:
    # Rank 1's answer is absent because it died: built from a recorded answer of rank 0 alone.
    pytest.importorskip("torch")
    states = [RankEvidence(0, answer={"fr": {"entries": [
        {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 2,
         "p2p_seq_id": 0, "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"],
         "output_sizes": [[4]], "output_dtypes": ["Float"], "state": "scheduled", "retired": False,
         "is_p2p": False, "time_created_ns": 0}],
        "pg_status": {"0": {"last_completed_collective": 1}}},
        "groups": {"0": {"ranks": [0, 1], "default": True}}, "stack": [], "in_cell": True, "now_ns": 10**10}),
        RankEvidence(1, dead="exit code 3")]
    verdict = analyse(states)
    assert verdict.sentence == ("all_reduce #2 (float32[4], default group): rank 0 waits in it; "
                                "rank 1 died (exit code 3)")


# ------------------------------------------------------------------ NCCL's recorder, on CPU
# A CPU build of torch has no NCCL and no NCCL recorder: the dumps below stand in for what torch
# 2.11's ``_dump_nccl_trace_json`` writes (the fields of FlightRecorderDetail.hpp's dump_json).
def nccl_entry(seq: int, name: str, sizes: list[list[int]], state: str, age_s: float) -> dict[str, Any]:
    import time

    return {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "time_created_ns": time.time_ns() - int(age_s * 1e9),
            "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes), "output_sizes": sizes,
            "output_dtypes": ["Float"] * len(sizes), "state": state, "time_discovered_started_ns": 0,
            "time_discovered_completed_ns": 0, "retired": False, "timeout_ms": 60000, "is_p2p": False}


def nccl_answer(entries: list[dict[str, Any]], enqueued: int, completed: int, stack: list[dict[str, Any]],
                cuda_busy: bool = False) -> dict[str, Any]:
    import time

    from clorch_repl.diagnosis.record import normalise

    status = {"0": {"last_enqueued_collective": str(enqueued), "last_started_collective": "-1",
                    "last_completed_collective": str(completed)}}
    return {"fr": normalise({"version": "2.10", "entries": entries, "pg_status": status}, "nccl"),
            "groups": {"0": {"ranks": [0, 1], "default": True}}, "stack": stack, "in_cell": True,
            "now_ns": time.time_ns(), "cuda_busy": cuda_busy}


def frame(file: str, line: int, function: str, cell: str | None = None) -> dict[str, Any]:
    return {"file": file, "line": line, "function": function, "code": "", "cell": cell, "library": cell is None}


def test_nccl_first_barrier_still_connecting_is_pending_not_completed() -> None:
    # NCCL's first collective of a communicator connects to its peers inside the call, before its
    # end event is recorded: the dump says "completed" and nothing is enqueued yet. Rank 1 sits
    # there (inside barrier()); rank 0 never called it and waits on its own GPU work.
    c10d = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    cuda_init = os.path.join("site-packages", "torch", "cuda", "__init__.py")
    waiting = nccl_answer([nccl_entry(1, "nccl:all_reduce_barrier", [[1]], "completed", 8.0)], enqueued=-1,
                          completed=-1, stack=[frame("/tmp/ipykernel_1/2.py", 6, "<module>", "Cell In[3]"),
                                               frame("/x/" + c10d, 5030, "barrier")])
    busy = nccl_answer([], enqueued=-1, completed=-1, cuda_busy=True,
                       stack=[frame("/tmp/ipykernel_2/2.py", 4, "<module>", "Cell In[3]"),
                              frame("/x/" + cuda_init, 1162, "synchronize")])
    verdict = analyse([RankEvidence(0, answer=busy), RankEvidence(1, answer=waiting)])
    assert verdict.stuck and verdict.waiting == [1] and verdict.missing == [0]
    assert verdict.pending_s is not None and verdict.pending_s >= 7.0
    assert verdict.sentence == ("barrier #1 (default group): rank 1 waits in it; rank 0 never called it and is at "
                                "Cell In[3], line 4 in <module>, inside synchronize() (torch/cuda/__init__.py:1162), "
                                "with its CUDA stream still busy")
    assert "    barrier #1 (no tensor) group 0: scheduled" in render.report(verdict, [RankEvidence(1, answer=waiting)])


def test_nccl_entries_launched_and_done_are_not_pending() -> None:
    # The same "completed" entry once the call returned (enqueued, the watchdog saw it finish):
    # both ranks through barrier #1, computing outside torch.distributed. No hang.
    done = [nccl_entry(1, "nccl:all_reduce_barrier", [[1]], "completed", 8.0),
            nccl_entry(2, "nccl:all_reduce", [[1024]], "completed", 7.0)]
    stack = [frame("/tmp/ipykernel_1/2.py", 9, "<module>", "Cell In[4]")]
    states = [RankEvidence(r, answer=nccl_answer(done, enqueued=2, completed=2, stack=stack)) for r in range(2)]
    verdict = analyse(states)
    assert not verdict.hang and verdict.sentence.startswith("no collective is pending"), verdict.sentence
    # Called but not launched is still judged "in the call" only while the rank is inside
    # torch.distributed: the same record with the rank back in its own code is not a hang.
    states = [RankEvidence(r, answer=nccl_answer(done, enqueued=1, completed=1, stack=stack)) for r in range(2)]
    assert not analyse(states).hang


def test_both_recorders_are_read_and_kept_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    torch_c10d = pytest.importorskip("torch._C._distributed_c10d")
    from clorch_repl.diagnosis import probe, record as fr
    from clorch_repl.wire.probe import ProbeRequest

    nccl = {"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": "3", "last_started_collective": "-1",
                                                   "last_completed_collective": "2"}},
            "entries": [nccl_entry(3, "nccl:all_reduce", [[1024]], "scheduled", 2.0)]}
    # No NCCL in a CPU build: its dump is the stand-in above (torch >= 2.5 has the function on CUDA).
    monkeypatch.setattr(torch_c10d, "_dump_nccl_trace_json", lambda: json.dumps(nccl).encode(), raising=False)
    data, missing = fr.read()
    assert missing is None and data is not None
    assert [e["recorder"] for e in data["entries"]][-1:] == ["nccl"]
    assert data["pg_status"]["nccl/0"]["last_completed_collective"] == 2
    answer = probe.answer(ProbeRequest())
    assert answer["fr"]["entries"][-1]["profiling_name"] == "nccl:all_reduce"


# ------------------------------------------------------------------ answers of real NCCL ranks
RECORDED = os.path.join(os.path.dirname(HERE), "gpu", "recorded")


def recorded_nccl(name: str) -> list[RankEvidence]:
    """Answers given by 2 real NCCL ranks (2 H200s, torch 2.11, NCCL 2.28) while blocked, kept by
    tests/gpu/test_gpu_hang.py (CLORCH_KEEP_ANSWERS): NCCL's records as torch writes them."""
    states = []
    for r in range(2):
        with open(os.path.join(RECORDED, f"nccl-{name}-{r}.json")) as fh:
            states.append(RankEvidence(r, answer=json.load(fh)))
    return states


def test_recorded_nccl_ranks_one_skips_while_the_other_waits_in_item() -> None:
    pytest.importorskip("torch")
    states = recorded_nccl("skip")
    verdict = analyse(states)
    assert verdict.stuck and verdict.waiting == [0] and verdict.missing == [1]
    # The path is as recorded there, shown relative to the working directory when it lies below it.
    assert re.fullmatch(r"all_reduce #3 \(float32\[1024\], default group\): rank 0 waits in it; rank 1 never "
                        r"called it and is at \S*tests/hang_scenarios\.py:23 in load_batch\(\)", verdict.sentence)
    text = render.report(verdict, states)
    assert "    barrier #1 (no tensor) group 0: completed" in text  # nccl:all_reduce_barrier
    assert "    all_reduce #3 (float32[1024]) group 0: scheduled" in text
    assert "  CUDA stream busy: yes" in text  # rank 0, blocked in .item()


def test_recorded_nccl_ranks_with_different_sizes() -> None:
    pytest.importorskip("torch")
    verdict = analyse(recorded_nccl("sizes"))
    assert verdict.stuck and verdict.mismatch
    assert verdict.sentence == ("all_reduce #3 (float32[4], default group): rank 0 passed float32[4], "
                                "rank 1 passed float32[1048576]; ranks 0-1 wait in it")


def test_a_rank_in_library_code_only_shows_two_frames_not_a_dozen() -> None:
    # A library's callback that IPython runs around the cell (a post_run_cell hook, say).
    stack = [frame("/x/site-packages/IPython/core/events.py", 89, "trigger")]
    stack += [frame("/x/site-packages/pygments/lexer.py", 565 + i, "_process_state") for i in range(14)]
    state = RankEvidence(1, answer={"fr": None, "fr_missing": "off", "stack": stack, "in_cell": True})
    text = "\n".join(render.evidence([state]))
    assert text.endswith("  in library code outside its cell's lines: IPython/core/events.py:89 in "
                         "trigger() ... pygments/lexer.py:578 in _process_state()"), text
    assert "pygments/lexer.py:570" not in text


def test_a_survivor_writing_its_traceback_is_said_to_have_raised() -> None:
    """A survivor of a dead peer, asked while IPython formats its cell's traceback (IPython, then
    pygments): it was said to be "in library code outside its cell's lines: ...showtraceback()
    ... pygments", as if it were somewhere unknown; its cell has raised, and its traceback says where."""
    stack = [frame("/x/site-packages/IPython/core/interactiveshell.py", 2279, "showtraceback")]
    stack += [frame("/x/site-packages/pygments/lexer.py", 565 + i, "_process_state") for i in range(14)]
    state = RankEvidence(1, answer={"fr": None, "fr_missing": "off", "stack": stack, "in_cell": True})
    text = "\n".join(render.evidence([state]))
    assert text.endswith("  its cell had already failed (its traceback is among the cell's errors)"), text
    assert "pygments" not in text and "library code" not in text
