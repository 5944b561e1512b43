"""The rank's half of ``%%distributed --profile``: torch.profiler around one cell, its trace and
a summary of where the rank's time went.

The notebook sends :func:`start` before the cell and :func:`stop` after it, as silent requests
(:mod:`clorch_repl.diagnosis.profile`). :func:`start` waits at a barrier of the chosen ranks and
then marks the instant in the trace (``clorch:start``): that mark is each rank's time zero when the
traces are merged, so ranks on hosts whose clocks differ still line up (barrier exits are
simultaneous within the network's latency). :func:`stop` writes the rank's Chrome trace and
announces a summary in a private display message that the notebook consumes (never shown):
per-operator self times, split into compute and collectives, and the cell's wall time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MIME", "START_MARK", "is_collective", "start", "stop", "trace_times"]

#: Private MIME type of the display message that carries a rank's profile summary.
MIME = "application/x-clorch-profile+json"
#: The record_function that marks each rank's time zero in its trace.
START_MARK = "clorch:start"
#: Name fragments of the operators that are communication (c10d's ops, gloo's and NCCL's own
#: records and kernels): time in them is a rank waiting for, or exchanging with, the others.
_COLLECTIVE_MARKS = ("c10d::", "gloo:", "nccl", "record_param_comms")
TOP_OPS = 12

_state: dict[str, Any] = {}


def is_collective(name: str) -> bool:
    """Whether an operator or kernel of this name is communication between ranks."""
    lowered = name.lower()
    return any(mark in lowered for mark in _COLLECTIVE_MARKS)


def start() -> None:
    """Start the profiler after a barrier of the session's group, marking time zero."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    if _state.get("profiler") is not None:  # a cell interrupted before its stop: end that one first
        _state.pop("profiler").stop()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities, record_shapes=False, with_stack=False)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    profiler.start()
    with torch.profiler.record_function(START_MARK):
        _state.update(profiler=profiler, started=time.perf_counter())


def stop(path: str) -> None:
    """Stop the profiler, write the Chrome trace to ``path`` and announce the summary."""
    profiler = _state.pop("profiler", None)
    if profiler is None:
        raise RuntimeError("the profiler of this cell was not running on this rank (its start failed)")
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - _state.pop("started")
    profiler.stop()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    profiler.export_chrome_trace(path)
    summary = _summary(profiler, wall_s)
    with open(path, encoding="utf-8") as fh:
        summary.update(trace_times(json.load(fh).get("traceEvents", [])))
    summary["trace"] = path
    summary["host"] = os.uname().nodename
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("the profile summary is announced through the rank's kernel, and none runs here")
    shell.display_pub.publish(data={MIME: json.dumps(summary)}, metadata={})


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


def _summary(profiler: Any, wall_s: float) -> dict[str, Any]:
    """Self times per operator (CPU, and device where kernels ran), split by kind."""
    ops: dict[str, dict[str, float]] = {}
    for event in profiler.key_averages():
        if event.key == START_MARK:
            continue
        cpu = float(event.self_cpu_time_total) / 1e6
        device = float(getattr(event, "self_device_time_total", 0.0) or 0.0) / 1e6
        if cpu <= 0 and device <= 0:
            continue
        ops[event.key] = {"cpu_s": cpu, "device_s": device, "count": int(event.count)}
    compute_cpu = sum(v["cpu_s"] for k, v in ops.items() if not is_collective(k))
    comm_cpu = sum(v["cpu_s"] for k, v in ops.items() if is_collective(k))
    compute_dev = sum(v["device_s"] for k, v in ops.items() if not is_collective(k))
    comm_dev = sum(v["device_s"] for k, v in ops.items() if is_collective(k))
    top = sorted(ops.items(), key=lambda kv: -(kv[1]["cpu_s"] + kv[1]["device_s"]))[:TOP_OPS * 4]
    return {"wall_s": wall_s, "compute_cpu_s": compute_cpu, "collective_cpu_s": comm_cpu,
            "compute_device_s": compute_dev, "collective_device_s": comm_dev, "ops": dict(top)}
