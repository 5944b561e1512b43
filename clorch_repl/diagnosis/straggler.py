"""Where each rank's time went in a profiled cell, which rank the others waited for, and one trace
of all of them: pure functions of the ranks' summaries and traces (written on each rank by
:mod:`clorch_repl.kernel.profiler`, which reads its own trace with :func:`trace_times`).

The verdict compares compute: time in operators that are not communication (self times, so a
``matmul`` and the ``mm`` inside it count once). On GPUs the device's kernel times decide, on CPUs
the host's. A rank is the straggler when its compute exceeds the median of the other ranks' by
:data:`STRAGGLER_MIN_FRACTION` and :data:`STRAGGLER_MIN_S`; its extra time is explained by the
operators whose time grew most against the others' median, and the others' waiting by their
largest communication operators (a fast rank's collective lasts until the slow rank joins it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from ..errors import rank_words

__all__ = ["Straggler", "find_straggler", "rank_lines", "merge_traces", "STRAGGLER_MIN_FRACTION",
           "STRAGGLER_MIN_S", "MIME", "START_MARK", "is_collective", "trace_times"]

#: Private MIME type of the display message that carries a rank's profile summary.
MIME = "application/x-clorch-profile+json"
#: The record_function that marks each rank's time zero in its trace.
START_MARK = "clorch:start"
#: Name fragments of the operators that are communication (c10d's ops, gloo's and NCCL's own
#: records and kernels): time in them is a rank waiting for, or exchanging with, the others.
_COLLECTIVE_MARKS = ("c10d::", "gloo:", "nccl", "record_param_comms")

#: How much more compute than the others' median makes a rank a straggler (and at least this many
#: seconds: a millisecond cell's noise is no straggler).
STRAGGLER_MIN_FRACTION = 0.15
STRAGGLER_MIN_S = 0.005


@dataclass(frozen=True)
class Straggler:
    """The rank the others waited for, and why."""

    rank: int
    compute_s: float
    others_s: float
    #: (operator, seconds more than the other ranks' median), largest first
    extra_ops: tuple[tuple[str, float], ...]
    #: (collective operator, seconds the other ranks spent in it: their median), largest first
    waits: tuple[tuple[str, float], ...]
    others: tuple[int, ...]

    def sentence(self) -> str:
        extra = self.compute_s - self.others_s
        pct = 100.0 * extra / self.others_s if self.others_s > 0 else float("inf")
        where = ", ".join(f"{name} (+{_ms(s)})" for name, s in self.extra_ops[:2]) or "no single operator"
        waits = ", ".join(f"{name} ({_ms(s)})" for name, s in self.waits[:2])
        verb = "waits" if len(set(self.others)) == 1 else "wait"  # "rank 0 waits", "ranks 0-1 wait"
        wait_text = f"; {rank_words(self.others)} {verb} for it in {waits}" if waits else ""
        return (f"rank {self.rank} is the straggler: {_ms(extra)} more compute than the others "
                f"({_ms(self.compute_s)} against {_ms(self.others_s)}, +{pct:.0f} %), most of it in "
                f"{where}{wait_text}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _kind(summaries: dict[int, dict[str, Any]]) -> str:
    """"device" when kernels ran on a GPU on any rank, else "cpu"."""
    return "device" if any(s.get("compute_device_s", 0.0) > 0 for s in summaries.values()) else "cpu"


def find_straggler(summaries: dict[int, dict[str, Any]]) -> Straggler | None:
    """The rank whose compute exceeds the others' clearly; None when the ranks are even (or one)."""
    if len(summaries) < 2:
        return None
    kind = _kind(summaries)
    compute = {r: float(s.get(f"compute_{kind}_s", 0.0)) for r, s in summaries.items()}
    slow = max(compute, key=lambda r: compute[r])
    others = [r for r in summaries if r != slow]
    others_s = statistics.median(compute[r] for r in others)
    extra = compute[slow] - others_s
    if extra < STRAGGLER_MIN_S or extra < STRAGGLER_MIN_FRACTION * others_s:
        return None
    key = f"{kind}_s"

    def op_time(rank: int, name: str) -> float:
        return float(summaries[rank].get("ops", {}).get(name, {}).get(key, 0.0))

    def wait_time(rank: int, name: str) -> float:  # how long the rank's records of it lasted
        spans = summaries[rank].get("collective_spans")
        return float(spans.get(name, 0.0)) if isinstance(spans, dict) else op_time(rank, name)

    names = {n for s in summaries.values() for n in s.get("ops", {}) if n != START_MARK}
    grew = sorted(((n, op_time(slow, n) - statistics.median(op_time(r, n) for r in others))
                   for n in names if not is_collective(n)), key=lambda kv: -kv[1])
    comm_names = names | {n for s in summaries.values() for n in (s.get("collective_spans") or {})}
    waits = sorted(((n, statistics.median(wait_time(r, n) for r in others)) for n in comm_names
                    if is_collective(n)), key=lambda kv: -kv[1])
    worth = max(STRAGGLER_MIN_S / 5, 0.05 * extra)  # an operator that explains a twentieth of it, at least
    return Straggler(rank=slow, compute_s=compute[slow], others_s=others_s,
                     extra_ops=tuple((n, s) for n, s in grew if s >= worth)[:3],
                     waits=tuple((n, s) for n, s in waits if s >= STRAGGLER_MIN_S / 5)[:3],
                     others=tuple(sorted(others)))


def rank_lines(summaries: dict[int, dict[str, Any]]) -> list[str]:
    """One line per rank: the cell's wall time, and its time in compute, in collectives and the rest."""
    kind = _kind(summaries)
    lines = []
    for rank in sorted(summaries):
        s = summaries[rank]
        compute = float(s.get(f"compute_{kind}_s", 0.0))
        comm = float(s.get("collective_span_s", s.get(f"collective_{kind}_s", 0.0)))
        wall = float(s.get("span_s", s.get("wall_s", 0.0)))
        rest = max(wall - compute - comm, 0.0) if kind == "cpu" else None
        rest_text = f", other {_ms(rest)}" if rest is not None else ""
        where = "GPU kernels" if kind == "device" else "CPU"
        lines.append(f"rank {rank}: {_ms(wall)} profiled; {where}: compute {_ms(compute)}, "
                     f"in collectives (waiting included) {_ms(comm)}{rest_text}")
    return lines


def merge_traces(traces: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One Chrome/Perfetto trace of every rank: rank R is process R (named "rank R"), and every
    rank's events are shifted so that its ``clorch:start`` mark is time zero."""
    events: list[dict[str, Any]] = []
    for rank in sorted(traces):
        own = [e for e in traces[rank].get("traceEvents", []) if isinstance(e, dict)]
        marks = [e.get("ts") for e in own if e.get("name") == START_MARK and isinstance(e.get("ts"), (int, float))]
        zero = min(marks) if marks else min((e["ts"] for e in own if isinstance(e.get("ts"), (int, float))),
                                            default=0.0)
        for event in own:
            moved = dict(event)
            moved["pid"] = rank
            if isinstance(moved.get("ts"), (int, float)):
                moved["ts"] = moved["ts"] - zero
            if moved.get("ph") == "M" and moved.get("name") == "process_name":
                continue  # replaced by ours below
            events.append(moved)
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "clorch_repl %%distributed --profile", "ranks": sorted(traces)}}


def is_collective(name: str) -> bool:
    """Whether an operator or kernel of this name is communication between ranks."""
    lowered = name.lower()
    return any(mark in lowered for mark in _COLLECTIVE_MARKS)


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by ``intervals`` (microseconds, possibly overlapping)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total / 1e6


def trace_times(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From a rank's trace events: the cell's span after the start mark, the time covered by
    communication (any thread: gloo works on threads of its own, and a collective's record lasts
    until the slowest rank joined it, so this is where a fast rank's waiting shows), and each
    collective's total duration by name."""
    timed = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
    marks = [e["ts"] for e in timed if e.get("name") == START_MARK]
    zero = min(marks) if marks else min((e["ts"] for e in timed), default=0.0)
    end = max((e["ts"] + float(e.get("dur", 0.0)) for e in timed), default=zero)
    comm = [e for e in timed if is_collective(str(e.get("name", ""))) and e["ts"] >= zero]
    spans: dict[str, float] = {}
    for e in comm:
        spans[e["name"]] = spans.get(e["name"], 0.0) + float(e.get("dur", 0.0)) / 1e6
    return {"span_s": max(end - zero, 0.0) / 1e6,
            "collective_span_s": _union_s([(e["ts"], e["ts"] + float(e.get("dur", 0.0))) for e in comm]),
            "collective_spans": spans}
