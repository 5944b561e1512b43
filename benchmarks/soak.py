"""Soak: many ``%%distributed`` cells with random output, rank deaths and restarts; reports leaks.

    python benchmarks/soak.py [--cells 10000] [--minutes 30] [--nproc 2] [--seed 0]

Not part of CI. Drives a real notebook kernel (tests/notebook_kernel.py, as JupyterLab does) and
runs cells of random output size (nothing, a few lines, thousands of lines, ``\\r`` progress
bars), now and then kills a rank mid-cell (``os._exit`` or SIGKILL) and restarts the group, or
restarts a healthy one, or lets a cell hit ``--timeout``, or floods the output on every rank
(``while True: print(...)``) until ``--timeout``, until Kernel > Interrupt, or for 100,000 lines
(issue 24: the cell must end within 2 s of its deadline or of the interrupt, show each rank's
held-back line, and leave the next cell clean). Every cell must end (a cell that does not
end within 120 s is counted as a wedge, and the session is restarted) and must show what it
printed. Every 500 cells, and at the end, it samples what a leak would grow: the notebook
kernel's RSS and open fds, the processes of the session (below the notebook kernel) and of any
clorch rank or supervisor that is not (orphans), and the ``clorch-*`` directories in the temp
dir. Exit status 1 on a wedge, a wrong cell, anything left behind after the final stop, or the
notebook kernel's RSS growing by more than ``--max-rss-growth`` MiB between the sample after 50
cells and the last one (issue 24: the notebook's memory stays flat over many cells).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from notebook_kernel import NotebookKernel  # noqa: E402  (a real notebook kernel, as JupyterLab runs it)

SIZES = (0, 1, 10, 100, 1000, 10000)
INFO = ("from clorch_repl.magics import magics_for\n_s = magics_for(get_ipython()).session\n"
        "print('SOAK', _s.group.dir, *_s.pids(), *[p.pid for p in _s.group.ranks])")


class Seen:
    """Every rank process and session directory this soak's sessions ever had (other people's
    sessions on the same machine are not counted)."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self.dirs: set[str] = set()

    def record(self, nb: NotebookKernel) -> None:
        line = next(l for l in nb.run(INFO).text.splitlines() if l.startswith("SOAK"))
        _, directory, *pids = line.split()
        self.dirs.add(directory)
        self.pids.update(int(p) for p in pids)

    def alive(self) -> set[int]:
        return {p for p in self.pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}

    def left_dirs(self, current: str | None) -> set[str]:
        return {d for d in self.dirs if d != current and os.path.exists(d)}


#: IPython 9 keeps every cell's stdout/stderr text in ``history_manager.outputs`` (for %history
#: -o), in any notebook, so the notebook kernel's RSS grows with the output shown; this measures
#: that share so that what is left can be put down to clorch_repl.
RETAINED = ("_h = get_ipython().history_manager\n"
            "print('RETAINED', sum(len(x) for outs in _h.outputs.values() for o in outs "
            "for x in o.bundle.get('stream', ())))")


def log_mb(directories: set[str]) -> float:
    """The largest rank log on disk (``rankN.log`` and its older half ``rankN.log.1``, capped by
    CLORCH_LOG_CAP) in the session directories still there."""
    sizes: dict[str, int] = {}
    for directory in directories:
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            if name.startswith("rank") and (name.endswith(".log") or name.endswith(".log.1")):
                key = os.path.join(directory, name.removesuffix(".1"))
                try:
                    sizes[key] = sizes.get(key, 0) + os.path.getsize(os.path.join(directory, name))
                except FileNotFoundError:  # rotated away between the listing and the look
                    continue
    return max(sizes.values(), default=0) / 2**20


def sample(nb: NotebookKernel, seen: Seen) -> dict[str, float]:
    line = next(l for l in nb.run(RETAINED).text.splitlines() if l.startswith("RETAINED"))
    proc = psutil.Process(nb.pid)
    tree = {p.pid for p in proc.children(recursive=True)}
    return {"rss_mb": proc.memory_info().rss / 2**20, "fds": proc.num_fds(), "procs": len(tree),
            "orphans": len(seen.alive() - tree), "dirs": len([d for d in seen.dirs if os.path.exists(d)]),
            "ipython_mb": int(line.split()[1]) / 2**20, "log_mb": log_mb(seen.dirs)}


def output_cell(i: int, rng: random.Random) -> tuple[str, list[str]]:
    lines = rng.choices(SIZES, weights=(20, 30, 20, 15, 10, 5))[0]
    kind = rng.random()
    if kind < 0.15:
        code = (f"import sys\nfor k in range({lines * 10}):\n    sys.stderr.write('\\r%6d ' % k); "
                f"sys.stderr.flush()\nsys.stderr.write('\\n')\nprint('END {i}', rank)")
    elif kind < 0.25:
        code = f"import os\nos.write(1, b'native ' * {lines * 20} + b'\\n')\nprint('END {i}', rank)"
    else:
        code = f"for k in range({lines}):\n    print('line', k, 'x' * (k % 97))\nprint('END {i}', rank)"
    return code, [f"END {i} 0", f"END {i} 1"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=10000)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forget-ipython-outputs", action="store_true",
                    help="clear IPython's record of each cell's output after the cell, so that the "
                         "notebook kernel's RSS shows clorch_repl's own growth")
    ap.add_argument("--max-rss-growth", type=float, default=40.0, metavar="MIB",
                    help="fail when the notebook kernel's RSS grows by more than this between the sample "
                         "after 50 cells and the last (IPython's bounded record of output is up to 13 MiB of it)")
    args = ap.parse_args()
    if args.cells < 1 or args.minutes <= 0 or args.nproc < 1:
        ap.error("--cells, --minutes and --nproc must be positive")
    rng = random.Random(args.seed)
    seen = Seen()
    nb = NotebookKernel()
    counts = {"output": 0, "death": 0, "restart": 0, "timeout": 0, "flood_timeout": 0, "flood_interrupt": 0,
              "flood": 0, "wedge": 0, "wrong": 0}
    times: list[float] = []
    #: seconds past a flood's --timeout deadline / past its interrupt until the cell ended
    late_timeout: list[float] = []
    late_interrupt: list[float] = []
    flood_bytes: list[int] = []
    peak_rss = 0.0
    samples: list[tuple[int, dict[str, float]]] = []
    end_at = time.monotonic() + args.minutes * 60
    t_start = time.monotonic()
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        if args.forget_ipython_outputs:
            nb.run("get_ipython().events.register('post_run_cell', "
                   "lambda _r: get_ipython().history_manager.outputs.clear())")
        assert nb.run(f"%clorch start --nproc {args.nproc}").status == "ok"
        seen.record(nb)
        cells = 0
        while cells < args.cells and time.monotonic() < end_at:
            cells += 1
            roll = rng.random()
            t0 = time.monotonic()
            try:
                if roll < 0.03:
                    victim = rng.randrange(args.nproc)
                    how = rng.choice(["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
                    reply = nb.run(f"%%distributed\nimport os, signal, time\nprint('pre', rank, flush=True)\n"
                                   f"if rank == {victim}:\n    {how}\ntime.sleep(0.2)", timeout=120)
                    ok = reply.status == "error" and f"rank {victim} died" in reply.text
                    counts["death"] += 1
                    restarted = nb.run("%clorch restart", timeout=180)
                    ok = ok and restarted.status == "ok"
                    seen.record(nb)
                elif roll < 0.04:
                    reply = nb.run("%clorch restart", timeout=180)
                    ok = reply.status == "ok"
                    counts["restart"] += 1
                    seen.record(nb)
                elif roll < 0.05:
                    reply = nb.run("%%distributed --timeout 1\nimport time\nprint('sleeping', flush=True)\n"
                                   "time.sleep(30)", timeout=120)
                    ok = reply.status == "error" and "after 1 s" in reply.text
                    counts["timeout"] += 1
                elif roll < 0.06:
                    reply = nb.run("%%distributed --timeout 3\nwhile True:\n    print('spam ' * 20)", timeout=120)
                    late_timeout.append(time.monotonic() - t0 - 3)
                    flood_bytes.append(len(reply.text))
                    ok = reply.status == "error" and "after 3 s" in reply.text and "held back" in reply.text
                    counts["flood_timeout"] += 1
                elif roll < 0.07:
                    msg_id = nb.send("%%distributed\nprint('flooding', flush=True)\nwhile True:\n    print('x' * 80)")
                    nb.wait_for_output(msg_id, "flooding", timeout=60)
                    time.sleep(2)
                    t1 = time.monotonic()
                    nb.km.interrupt_kernel()
                    reply = nb.collect(msg_id, timeout=120)
                    late_interrupt.append(time.monotonic() - t1)
                    flood_bytes.append(len(reply.text))
                    ok = reply.status == "error" and "held back" in reply.text
                    counts["flood_interrupt"] += 1
                elif roll < 0.08:
                    reply = nb.run("%%distributed\nfor k in range(100_000):\n    print('flood', k)", timeout=120)
                    flood_bytes.append(len(reply.text))
                    ok = reply.status == "ok" and "clorch held back" in reply.text  # one line, at the top
                    counts["flood"] += 1
                else:
                    code, expected = output_cell(cells, rng)
                    reply = nb.run("%%distributed\n" + code, timeout=120)
                    # a cell past the cell's output limits says so in one line at the top instead
                    ok = reply.status == "ok" and all(e in reply.text or e.replace(" 0", "") in reply.text
                                                      or "clorch held back" in reply.text
                                                      for r, e in enumerate(expected[:args.nproc]))
                    ok = ok and "dropped" not in reply.text and "spam" not in reply.text
                    counts["output"] += 1
                    times.append(time.monotonic() - t0)
                if not ok:
                    counts["wrong"] += 1
                    print(f"cell {cells}: unexpected result:\n{reply.text[-1500:]}", flush=True)
            except TimeoutError:
                counts["wedge"] += 1
                print(f"cell {cells}: WEDGED (no end within 120 s); restarting", flush=True)
                nb.km.interrupt_kernel()
                time.sleep(2)
                nb.run("%clorch restart", timeout=300)
                seen.record(nb)
            peak_rss = max(peak_rss, psutil.Process(nb.pid).memory_info().rss / 2**20)
            if cells % 500 == 0 or cells == 50:
                samples.append((cells, sample(nb, seen)))
                s = samples[-1][1]
                print(f"{cells:6d} cells {time.monotonic() - t_start:7.0f} s  rss {s['rss_mb']:.1f} MB "
                      f"(IPython keeps {s['ipython_mb']:.1f} MB of output text)  "
                      f"fds {s['fds']:.0f}  procs {s['procs']:.0f}  orphans {s['orphans']:.0f}  "
                      f"dirs {s['dirs']:.0f}  largest rank log {s['log_mb']:.1f} MiB  {counts}", flush=True)
        samples.append((cells, sample(nb, seen)))
        nb.run("%clorch stop", timeout=60)
        after_stop = sample(nb, seen)
    finally:
        nb.shutdown()
    time.sleep(1)
    left_procs = seen.alive()
    left_dirs = seen.left_dirs(None)
    elapsed = time.monotonic() - t_start
    first = next(s for n, s in samples if n >= 50) if samples else {}
    last = samples[-1][1]
    print()
    print(f"soak: {cells} cells in {elapsed / 60:.1f} min, {args.nproc} ranks, seed {args.seed}")
    print(f"  kinds: {counts}")
    if times:
        q = statistics.quantiles(times, n=100, method="inclusive")
        print(f"  output cells: p50 {statistics.median(times) * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms, "
              f"max {max(times) * 1000:.0f} ms")
    print(f"  notebook kernel RSS: {first.get('rss_mb', 0):.1f} MB after 50 cells -> {last['rss_mb']:.1f} MB "
          f"after {samples[-1][0]}; of which IPython's own record of cell output (history_manager.outputs): "
          f"{first.get('ipython_mb', 0):.1f} -> {last['ipython_mb']:.1f} MB")
    print(f"  notebook kernel RSS peak (sampled after every cell): {peak_rss:.1f} MB")
    for name, late in (("--timeout 3 under a flood", late_timeout), ("Kernel > Interrupt under a flood", late_interrupt)):
        if late:
            print(f"  {name}: ended {statistics.median(late):.2f} s (median), {max(late):.2f} s (max) past "
                  f"its deadline / the interrupt, {len(late)} cells")
    if flood_bytes:
        print(f"  flood cells: at most {max(flood_bytes) / 2**20:.2f} MiB of text reached the client "
              f"(median {statistics.median(flood_bytes) / 2**20:.2f} MiB)")
    print(f"  largest rank log on disk at any sample: {max(s['log_mb'] for _, s in samples):.1f} MiB "
          f"(cap {os.environ.get('CLORCH_LOG_CAP', '64M')})")
    print(f"  notebook kernel fds: {first.get('fds', 0):.0f} -> {last['fds']:.0f}")
    print(f"  processes below the notebook: {first.get('procs', 0):.0f} -> {last['procs']:.0f}; "
          f"after stop {after_stop['procs']:.0f}; orphaned ranks at any sample: "
          f"{max(s['orphans'] for _, s in samples):.0f}")
    print(f"  after the notebook's shutdown: {len(left_procs)} of the {len(seen.pids)} rank processes "
          f"(kernels and supervisors) ever started left, {len(left_dirs)} of {len(seen.dirs)} session "
          f"directories left {sorted(left_dirs)[:5]}")
    growth = last["rss_mb"] - first.get("rss_mb", last["rss_mb"])
    grew = growth > args.max_rss_growth
    print(f"  notebook kernel RSS growth after the first 50 cells: {growth:.1f} MiB (bound {args.max_rss_growth:g} MiB)")
    bad = counts["wedge"] or counts["wrong"] or left_procs or left_dirs or grew
    print("  result:", "FAIL" if bad else "ok (no wedge, no wrong cell, nothing left behind, memory flat)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
