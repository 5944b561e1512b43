"""Widgets on ranks, as a front end sees them, beside the same widgets in the notebook kernel.

    python benchmarks/widgets.py [--iters 100] [--repeats 5]

1. Round trip of a widget update: the client sends what JupyterLab sends when a slider moves (a
   comm_msg with ipywidgets' ``update``) and waits for the kernel's idle status of that message
   (JupyterLab's widget manager sends the next update of a dragged slider only then). For a
   slider made on rank 1 this crosses the notebook kernel to the rank and back (see
   ``clorch_repl.notebook.comms``); the floor is a slider made in the notebook kernel itself,
   measured in the same run, in alternating rounds. Prints p50/p90 in ms and the ratio.
2. What forwarding a ``tqdm.auto`` widget bar costs a cell: a ``%%distributed`` loop of 200
   steps of 5 ms with a widget bar, beside the same loop with the bar disabled, alternating.
   Prints the median seconds, the spread and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from queue import Empty
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel, clorch_session  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)

LOOP = ("%%distributed\nimport time\nfrom tqdm.auto import tqdm\n"
        "for _ in tqdm(range(200), disable={disable}):\n    time.sleep(0.005)")


def until_idle(kernel: NotebookKernel, msg_id: str, timeout: float = 120.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    got = []
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=max(0.01, deadline - time.monotonic()))
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return got
        got.append(msg)
    raise TimeoutError(f"no idle status for {msg_id} within {timeout} s")


def slider_id(kernel: NotebookKernel, code: str, value: int) -> str:
    msg_id = kernel.send(code)
    for msg in until_idle(kernel, msg_id):
        if msg["msg_type"] == "comm_open" and msg["content"]["data"]["state"].get("value") == value:
            return msg["content"]["comm_id"]
    raise RuntimeError(f"no slider with value {value} was opened by {code!r}")


def update_round_trip(kernel: NotebookKernel, comm_id: str, value: int) -> float:
    msg = kernel.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "method": "update", "state": {"value": value}, "buffer_paths": []}})
    t0 = time.perf_counter()
    kernel.kc.shell_channel.send(msg)
    echoes = [m for m in until_idle(kernel, msg["header"]["msg_id"]) if m["msg_type"] == "comm_msg"]
    elapsed = time.perf_counter() - t0
    assert echoes, "the update was not echoed"
    return elapsed


def cell_seconds(kernel: NotebookKernel, code: str) -> float:
    t0 = time.perf_counter()
    reply = kernel.collect(kernel.send(code), timeout=300)
    assert reply.status == "ok", reply.text
    return reply.idle_at - t0


def ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=10)
    return f"p50 {statistics.median(samples) * 1e3:.2f} ms, p90 {q[8] * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with clorch_session() as kernel:
        local = slider_id(kernel, "import ipywidgets as w\ns = w.IntSlider(value=1000, max=10**9)\ndisplay(s)", 1000)
        remote = slider_id(kernel, "%%distributed\nimport ipywidgets as w\n"
                                   "s = w.IntSlider(value=2000 + rank, max=10**9)\ndisplay(s)", 2001)
        base: list[float] = []
        rank: list[float] = []
        for i in range(5):  # warm-up
            update_round_trip(kernel, local, i)
            update_round_trip(kernel, remote, i)
        for i in range(args.iters):
            base.append(update_round_trip(kernel, local, 10 + i))
            rank.append(update_round_trip(kernel, remote, 10 + i))
        print(f"widget update round trip, {args.iters} updates each:")
        print(f"  notebook kernel's own slider: {ms(base)}")
        print(f"  rank 1's slider:              {ms(rank)}")
        print(f"  ratio (p50): {statistics.median(rank) / statistics.median(base):.2f}x")
        kernel.run("%%distributed\nfrom tqdm.auto import tqdm")  # the import is not what is timed
        bar: list[float] = []
        plain: list[float] = []
        for _ in range(args.repeats):
            bar.append(cell_seconds(kernel, LOOP.format(disable=False)))
            plain.append(cell_seconds(kernel, LOOP.format(disable=True)))
        med_bar, med_plain = statistics.median(bar), statistics.median(plain)
        print(f"%%distributed loop of 200 x 5 ms, {args.repeats} runs each:")
        print(f"  tqdm.auto widget bar: {med_bar:.3f} s ({min(bar):.3f}-{max(bar):.3f})")
        print(f"  bar disabled:         {med_plain:.3f} s ({min(plain):.3f}-{max(plain):.3f})")
        print(f"  ratio (median): {med_bar / med_plain:.2f}x")


if __name__ == "__main__":
    main()
