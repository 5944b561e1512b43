"""Where a real ``%%distributed`` cell's time goes, from the client's send to its idle, beside ``pass``.

    python benchmarks/cell_timeline.py [--nprocs 64] [--cells 150]

Why: the empty cell at 64 ranks (issue 39) is timed end to end by ``start_scale.py``; this splits
one such cell into its stages, in the processes where they happen. A notebook kernel with
``--nprocs`` gloo ranks runs empty cells and ``pass``, interleaved in a random order; each
process notes when its stages begin and end with ``time.perf_counter`` (CLOCK_MONOTONIC, one
clock for every process of the host), by wrapping, from cells, the methods that run them:

* the client: the execute_request sent, its idle status read;
* the notebook kernel: ipykernel's shell dispatch (the head start's wrapper included; after
  IPython's ``run_cell`` it flushes the streams, sleeps its 0.5 ms, replies and says idle), the
  head start's send of the cell to the ranks (``HeadStart._begin``; the sends alone:
  ``Relay._send_all``, whose start is the "first send" below), IPython's ``run_cell``, and
  ``Session.finish`` (the magic's wait);
* each rank: its lean execute of the cell (``LeanExecute._lean_execute``: after the request was
  read and checked, until the reply is sent).

Each cell's stages are matched by time (the ranks' notes fall inside the client's span of the
cell) and printed as medians with [p10-p90] over the cells, in milliseconds. The wrappers cost
time of their own, in the cell and in ``pass`` alike: compare stages with each other and with
``pass``, not these totals with ``start_scale.py``'s (not measured: what the wrappers cost).
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)

CELL = "%%distributed\npass"
#: run in the notebook kernel once its session runs: the notebook's stages, noted in _EV
NOTEBOOK_NOTES = r'''
import time as _t
from clorch_repl.magics import magics_for as _mf
_ip = get_ipython(); _k = _ip.kernel; _m = _mf(_ip); _S = _m.session
_EV = []
def _noted(obj, name, key):
    orig = getattr(obj, name)
    if key == "dispatch":
        async def noted(*a, **kw):
            t0 = _t.perf_counter()
            try: return await orig(*a, **kw)
            finally: _EV.append((key, t0, _t.perf_counter()))
    else:
        def noted(*a, **kw):
            t0 = _t.perf_counter()
            try: return orig(*a, **kw)
            finally: _EV.append((key, t0, _t.perf_counter()))
    setattr(obj, name, noted)
_noted(_k, "dispatch_shell", "dispatch")
_noted(_m.head_start, "_begin", "head start")
_noted(_ip, "run_cell", "run_cell")
_noted(_S, "finish", "finish")
_noted(_S.relay, "_send_all", "sends")
'''
#: run on every rank: its lean execute's span, noted in _REV
RANK_NOTES = r'''%%distributed
import time as _t
_k = get_ipython().kernel
_REV = []
_lean = _k._lean_execute
async def _noted_lean(*a, **kw):
    t0 = _t.perf_counter()
    try: return await _lean(*a, **kw)
    finally: _REV.append((t0, _t.perf_counter()))
_k._lean_execute = _noted_lean
'''


def round_trip(nb: NotebookKernel, code: str) -> tuple[float, float]:
    """When the client sent ``code`` and when it read that request's idle status."""
    t0 = time.perf_counter()
    msg_id = nb.kc.execute(code)
    while True:
        msg = nb.kc.get_iopub_msg(timeout=60)
        if (msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id):
            break
    t1 = time.perf_counter()
    nb.kc.get_shell_msg(timeout=60)
    return t0, t1


def stages(kind: str, c0: float, c7: float, notes: list[tuple[str, float, float]],
           ranks: dict[int, list[tuple[float, float]]], nprocs: int) -> dict[str, float]:
    """One cell's stages (seconds) from the client's span [c0, c7] and every process's notes."""
    def one(key: str) -> tuple[float, float] | None:
        found = [(t0, t1) for k, t0, t1 in notes if k == key and c0 <= t0 <= c7]
        return found[0] if len(found) == 1 else None

    dispatch, run_cell = one("dispatch"), one("run_cell")
    if dispatch is None or run_cell is None:
        return {}
    n1, n6 = dispatch
    out = {"client -> dispatch": n1 - c0, "dispatch -> run_cell": run_cell[0] - n1,
           "run_cell": run_cell[1] - run_cell[0],
           "run_cell -> dispatch end (ipykernel: flush, sleep, reply)": n6 - run_cell[1],
           "dispatch end -> client idle": c7 - n6, "client total": c7 - c0}
    if kind == "pass":
        return out
    sent, sends, finish = one("head start"), one("sends"), one("finish")
    spans = [(t0, t1) for notes_of in ranks.values() for t0, t1 in notes_of if c0 <= t0 <= c7]
    if sent is None or sends is None or finish is None or len(spans) != nprocs:
        return {}
    starts = sorted(t0 for t0, _ in spans)
    last_reply = max(t1 for _, t1 in spans)
    out.update({
        "dispatch -> every rank sent the cell (head start)": sent[1] - n1,
        "  of it the sends": sends[1] - sends[0],
        "first send -> first rank starts": starts[0] - sends[0],
        "first send -> median rank starts": statistics.median(starts) - sends[0],
        "first send -> last rank starts": starts[-1] - sends[0],
        "first send -> last rank replied": last_reply - sends[0],
        "a rank's lean execute, median rank": statistics.median(t1 - t0 for t0, t1 in spans),
        "a rank's lean execute, slowest rank": max(t1 - t0 for t0, t1 in spans),
        "dispatch -> the magic waits (finish)": finish[0] - n1,
        "last rank replied -> finish returns": finish[1] - last_reply,
        "finish returns -> dispatch end": n6 - finish[1],
    })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=64)
    parser.add_argument("--cells", type=int, default=150, help="empty cells, and as many `pass`")
    args = parser.parse_args()
    nb = NotebookKernel(env={"CLORCH_SPARES": "0", "CLORCH_KEEP_LOGS": "0"})
    folder = tempfile.mkdtemp(prefix="clorch-timeline-")  # (the ranks' notes come back through files)
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        started = nb.run(f"%clorch start --nproc {args.nprocs} --backend gloo", timeout=600)
        assert started.status == "ok", started.text
        print(started.text.strip().splitlines()[-1])
        assert nb.run(RANK_NOTES).status == "ok"
        for _ in range(20):
            round_trip(nb, "pass")
            round_trip(nb, CELL)
        assert nb.run(NOTEBOOK_NOTES).status == "ok"
        assert nb.run("%%distributed\n_REV.clear()").status == "ok" and nb.run("_EV.clear()").status == "ok"
        client = []
        for _ in range(args.cells):
            for kind in random.sample(["pass", "cell"], 2):
                client.append((kind, *round_trip(nb, "pass" if kind == "pass" else CELL)))
        notes = ast.literal_eval(nb.run("print(repr(_EV))").text.strip())
        saved = nb.run(f"%%distributed\nopen(f'{folder}/rank{{rank}}.txt', 'w').write(repr(_REV))")
        assert saved.status == "ok", saved.text
        ranks = {}
        for r in range(args.nprocs):
            with open(os.path.join(folder, f"rank{r}.txt")) as fh:
                ranks[r] = ast.literal_eval(fh.read())
        nb.run("%clorch stop")
    finally:
        nb.shutdown()
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    table: dict[str, dict[str, list[float]]] = {"pass": {}, "cell": {}}
    for kind, c0, c7 in client:
        for name, seconds in stages(kind, c0, c7, notes, ranks, args.nprocs).items():
            table[kind].setdefault(name, []).append(seconds)
    for kind, rows in table.items():
        count = len(rows.get("client total", []))
        print(f"{'`pass`' if kind == 'pass' else 'empty cell'} at {args.nprocs} ranks ({count} of "
              f"{args.cells} matched), ms: median [p10-p90]")
        for name, samples in rows.items():
            if len(samples) < 2:
                print(f"  {name:58s} {statistics.median(samples) * 1e3:7.3f} (one cell)")
                continue
            deciles = statistics.quantiles(samples, n=10)
            print(f"  {name:58s} {statistics.median(samples) * 1e3:7.3f} [{deciles[0] * 1e3:.3f}-{deciles[8] * 1e3:.3f}]")


if __name__ == "__main__":
    main()
