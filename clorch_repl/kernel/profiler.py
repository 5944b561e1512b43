"""The rank's half of ``%%distributed --profile``: torch.profiler around one cell, its trace and
a summary of where the rank's time went.

The notebook sends :func:`start` before the cell and :func:`stop` after it, as silent requests
(:mod:`clorch_repl.session.profile`). What the notebook reads of a trace and a summary (the start
mark, which operators are communication, the trace's times) is
:mod:`clorch_repl.diagnosis.straggler`, shared by both sides. :func:`start` waits at a barrier of
the chosen ranks and then marks the instant in the trace (``clorch:start``): that mark is each
rank's time zero when the traces are merged, so ranks on hosts whose clocks differ still line up
(barrier exits are simultaneous within the network's latency). :func:`stop` writes the rank's Chrome
trace and announces a summary in a private display message that the notebook consumes (never shown):
per-operator self times, split into compute and collectives, and the cell's wall time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from ..diagnosis.straggler import MIME, START_MARK, is_collective, trace_times
from .shell import rank_shell

logger = logging.getLogger(__name__)

__all__ = ["start", "stop"]

TOP_OPS = 12

_state: dict[str, Any] = {}


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


def stop(folder: str) -> None:
    """Stop the profiler, write the Chrome trace to this rank's file in ``folder``
    (``rank-R.json``, R from its own ``RANK``: one request serves every rank) and announce the
    summary, which names the file."""
    path = os.path.join(folder, f"rank-{os.environ['RANK']}.json")
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
    shell = rank_shell("the profile summary's announcement")
    shell.display_pub.publish(data={MIME: json.dumps(summary)}, metadata={})


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
