"""``%%distributed --profile``: on a real 3-rank gloo session, one rank slowed on purpose (extra matmuls
on rank 2), the verdict names rank 2 and the operator, the merged trace is JSON with one process
per rank (tests/integration/test_profile_live.py); here the verdict's logic on recorded summaries."""

from __future__ import annotations

from clorch_repl.diagnosis import straggler


def _summary(compute: float, mm: float, comm: float) -> dict:
    return {"wall_s": compute + comm + 0.01, "compute_cpu_s": compute, "collective_cpu_s": comm,
            "compute_device_s": 0.0, "collective_device_s": 0.0,
            "ops": {"aten::mm": {"cpu_s": mm, "device_s": 0.0, "count": 1},
                    "aten::add": {"cpu_s": compute - mm, "device_s": 0.0, "count": 1},
                    "c10d::allreduce_": {"cpu_s": comm, "device_s": 0.0, "count": 1}}}


def test_the_verdict_on_recorded_summaries() -> None:
    even = {0: _summary(1.0, 0.8, 0.1), 1: _summary(1.05, 0.85, 0.08)}
    assert straggler.find_straggler(even) is None
    uneven = {0: _summary(1.0, 0.8, 0.9), 1: _summary(1.9, 1.7, 0.05), 2: _summary(1.02, 0.8, 0.88)}
    verdict = straggler.find_straggler(uneven)
    assert verdict is not None and verdict.rank == 1 and verdict.others == (0, 2)
    assert verdict.extra_ops[0][0] == "aten::mm"
    assert verdict.sentence() == ("rank 1 is the straggler: 890 ms more compute than the others (1900 ms against "
                                  "1010 ms, +88 %), most of it in aten::mm (+900 ms); ranks 0,2 wait for it in "
                                  "c10d::allreduce_ (890 ms)")
    assert straggler.find_straggler({0: _summary(1.0, 0.8, 0.1)}) is None
    two = straggler.find_straggler({0: _summary(1.0, 0.8, 0.9), 1: _summary(1.9, 1.7, 0.05)})
    assert two is not None and "; rank 0 waits for it in c10d::allreduce_" in two.sentence(), two  # one rank: waits


def test_collective_time_is_taken_from_the_trace_on_any_thread() -> None:
    from clorch_repl.diagnosis.straggler import trace_times

    events = [{"ph": "X", "name": "clorch:start", "ts": 100.0, "dur": 1.0, "tid": 1},
              {"ph": "X", "name": "aten::mm", "ts": 110.0, "dur": 50.0, "tid": 1},
              {"ph": "X", "name": "gloo:all_reduce", "ts": 200.0, "dur": 300.0, "tid": 7},  # gloo's thread
              {"ph": "X", "name": "c10d::allreduce_", "ts": 190.0, "dur": 20.0, "tid": 1},
              {"ph": "X", "name": "gloo:barrier", "ts": 50.0, "dur": 10.0, "tid": 7}]  # before the mark
    times = trace_times(events)
    assert times["span_s"] == 400e-6
    assert abs(times["collective_span_s"] - 310e-6) < 1e-12  # 190-500, overlaps counted once
    assert times["collective_spans"] == {"gloo:all_reduce": 300e-6, "c10d::allreduce_": 20e-6}


def test_merged_traces_start_each_rank_at_its_mark() -> None:
    traces = {r: {"traceEvents": [{"ph": "X", "name": "clorch:start", "ts": 1000.0 + 500 * r, "dur": 1, "pid": 99},
                                  {"ph": "X", "name": "aten::mm", "ts": 1010.0 + 500 * r, "dur": 5, "pid": 99},
                                  {"ph": "M", "name": "process_name", "pid": 99, "args": {"name": "python"}}]}
              for r in (0, 1)}
    merged = straggler.merge_traces(traces)
    mm = [e for e in merged["traceEvents"] if e.get("name") == "aten::mm"]
    assert [(e["pid"], e["ts"]) for e in mm] == [(0, 10.0), (1, 10.0)]
    names = [e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["rank 0", "rank 1"]
