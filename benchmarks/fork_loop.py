"""A forked rank's loop beside a fresh rank's: the same small loop in one rank of two sessions,
one whose ranks are forked from the zygote (the default) and one with ``CLORCH_FORK_RANKS=0``.

    python benchmarks/fork_loop.py [--rounds 30] [--seconds 0.4] [--loop mlp|python|both] [--device cpu|cuda]
                                   [--sides forked,fresh] [--start-args "--nproc 1 --backend gloo"]
                                   [--instances N] [--env NAME=VALUE ...]

Every side is a notebook kernel (a real ipykernel driven by jupyter_client, as
benchmarks/training.py drives one) with a session of its own; rank 0 runs the loop, the others
(if ``--start-args`` asks for more) stay idle. The sides (``--sides``): ``forked`` (the default
start) and ``fresh`` (``CLORCH_FORK_RANKS=0``). Each round runs the loop for about ``--seconds`` on every
side in turn (who goes first rotates), timed in blocks of about 0.1 s; ``--instances`` starts every
side anew that many times (a rank's own memory layout can move its speed by a few percent). The
loops (``--loop``): ``mlp``, a tiny MLP's forward, backward, SGD step and ``loss.item()`` on
``--device`` (launch-bound: the host's Python and dispatch decide); ``python``, a pure-Python loop
over small objects (no torch).

Printed: the host's THP settings; per side, steps/s, the loop thread's CPU per step (all blocks,
and the fastest quarter of the blocks: on a shared machine the best estimate of what a step costs),
minor page faults per step (``/proc/self/stat`` minflt, and the loop thread's own); each side's
speed against fresh per round and per instance (median [min-max]); then rank 0's state on every
side: AnonHugePages (``/proc/self/smaps``; a forked rank that lost its huge pages to copy-on-write
shows far fewer than a fresh one), glibc malloc's figures, anonymous pages by NUMA node and the
node it runs on, torch's thread counts, the collector, switch interval, affinity, its parent and
grandparent, and the environment variables that differ.

On a GPU host, to see whether forked ranks are slower there (issue 39; one H200 with THP
``madvise``, 8 rounds: forked/fresh steps/s 1.010 [0.816-1.308], docs/PERFORMANCE.md)::

    python benchmarks/fork_loop.py --device cuda --start-args "--nproc 1" --instances 3 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

PROBE = r'''%%distributed
import ctypes, gc, json, os, resource, sys, time, threading

def _minflt():
    with open("/proc/self/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[7])

def _smaps():
    """Anonymous memory by page size, and how much of it is in 2 MiB pages (kB)."""
    out = {"AnonHugePages": 0, "Anonymous": 0, "Rss": 0, "heap_AnonHugePages": 0, "thp_eligible_vmas": 0}
    cur = None
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and not head[0].endswith(":"):
                cur = line
                continue
            key = head[0].rstrip(":")
            if key in ("AnonHugePages", "Anonymous", "Rss"):
                out[key] += int(head[1])
                if key == "AnonHugePages" and cur is not None and "[heap]" in cur:
                    out["heap_AnonHugePages"] += int(head[1])
            if key == "THPeligible" and head[1] == "1":
                out["thp_eligible_vmas"] += 1
    return out

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

def _malloc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
        return {n: getattr(m, n) >> 10 for n, _ in _Mallinfo2._fields_ if n in ("arena", "hblks", "hblkhd", "fordblks", "keepcost")}
    except Exception as exc:
        return {"error": repr(exc)}

def _thp():
    out = {}
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as fh:
                out[name] = fh.read().strip()
        except OSError:
            pass
    try:
        import prctl_missing  # noqa
    except ImportError:
        pass
    libc = ctypes.CDLL(None, use_errno=True)
    out["PR_GET_THP_DISABLE"] = libc.prctl(42, 0, 0, 0, 0)
    return out

def _numa():
    """Pages of this process's anonymous memory on each NUMA node, and the node of the CPU it runs on."""
    nodes = {}
    try:
        with open("/proc/self/numa_maps") as fh:
            for line in fh:
                if " anon=" not in line:
                    continue
                for part in line.split():
                    if part[0] == "N" and "=" in part:
                        k, v = part.split("=")
                        nodes[k] = nodes.get(k, 0) + int(v)
        with open("/proc/thread-self/stat") as fh:
            cpu = int(fh.read().rsplit(")", 1)[1].split()[36])  # field 39, processor
        here = next((n for n in os.listdir("/sys/devices/system/node") if n.startswith("node")
                     and os.path.exists(f"/sys/devices/system/node/{n}/cpu{cpu}")), None)
        return {"anon_pages_by_node": nodes, "running_on": here}
    except OSError as exc:
        return {"error": repr(exc)}

def _state():
    import signal
    torch = sys.modules.get("torch")
    return {
        "pid": os.getpid(), "python": sys.version.split()[0],
        "torch_threads": torch.get_num_threads() if torch else None,
        "torch_interop": torch.get_num_interop_threads() if torch else None,
        "switchinterval": sys.getswitchinterval(), "gc_enabled": gc.isenabled(), "gc_threshold": gc.get_threshold(),
        "gc_freeze_count": gc.get_freeze_count(), "gc_count": gc.get_count(),
        "threads": len(os.listdir("/proc/self/task")), "affinity": len(os.sched_getaffinity(0)),
        "nice": os.nice(0), "flags": str(sys.flags), "recursionlimit": sys.getrecursionlimit(),
        "sigint": str(signal.getsignal(signal.SIGINT)), "sigchld": str(signal.getsignal(signal.SIGCHLD)),
        "malloc": _malloc(), "smaps": _smaps(), "numa": _numa(), "thp": _thp(), "env": dict(os.environ),
        "ancestors": [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:90] for p in
                      (os.getppid(), int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]))],
        "modules": len(sys.modules), "main": getattr(sys.modules.get("__main__"), "__file__", None),
    }

def _mlp_setup(device):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 10, (32,), device=device)
    loss_fn = torch.nn.functional.cross_entropy
    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    return step

def _python_setup(_device):
    class P:
        __slots__ = ("a", "b", "c")
        def __init__(self, a, b, c):
            self.a, self.b, self.c = a, b, c
    data = [P(i, str(i), {"k": i}) for i in range(20000)]
    def step():
        total = 0
        for p in data[::8]:
            total += p.a + len(p.b) + p.c["k"]
        tmp = [P(i, "x", None) for i in range(200)]
        return total + len(tmp)
    return step

_fork_loop_cache = {}

def _fork_loop_run(kind, device, seconds):
    if (kind, device, seconds) not in _fork_loop_cache:  # built and calibrated once per rank
        step = {"mlp": _mlp_setup, "python": _python_setup}[kind](device)
        for _ in range(50):
            step()
        t0 = time.perf_counter(); n = 0
        while time.perf_counter() - t0 < 0.3:
            step(); n += 1
        _fork_loop_cache[kind, device, seconds] = step, n
    step, n = _fork_loop_cache[kind, device, seconds]
    steps = max(100, int(n / 0.3 * seconds))
    for _ in range(20):
        step()
    # timed in blocks of about 0.1 s: on a shared machine the fastest blocks (and the loop thread's
    # CPU per step) say what the loop costs, the slowest what else ran meanwhile
    block = max(10, int(n / 0.3 * min(0.1, seconds / 4)))
    walls, cpus = [], []
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    f0 = _minflt()
    done = 0
    while done < steps:
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(block):
            step()
        w1, c1 = time.perf_counter(), time.thread_time()
        walls.append((w1 - w0) / block * 1e6); cpus.append((c1 - c0) / block * 1e6)
        done += block
    f1 = _minflt()
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    walls.sort(); cpus.sort()
    q = max(1, len(walls) // 4)
    return {"steps": done, "wall": sum(walls) * block / 1e6, "wall_us_best": sum(walls[:q]) / q,
            "loop_cpu_us": sum(cpus) / len(cpus), "cpu_us_best": sum(cpus[:q]) / q,
            "minflt": (f1 - f0) / done, "thread_minflt": (r1.ru_minflt - r0.ru_minflt) / done,
            "invol": (r1.ru_nivcsw - r0.ru_nivcsw) / done}
'''

RUN = '''%%distributed
if rank == 0:
    print("RESULT", json.dumps(_fork_loop_run({kind!r}, {device!r}, {seconds!r})))
'''

STATE = '''%%distributed
if rank == 0:
    print("RESULT", json.dumps(_state()))
'''


def spread(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


class Side:
    def __init__(self, label: str, env: dict[str, str], start: str) -> None:
        from notebook_kernel import NotebookKernel

        self.label = label
        self.kernel = NotebookKernel(env)
        self._run("%load_ext clorch_repl")
        print(f"{label}: {self._run(f'%clorch start {start}').text.strip().splitlines()[-1]}", flush=True)
        self._run(PROBE)

    def _run(self, code: str) -> Any:
        reply = self.kernel.run(code, timeout=600)
        if reply.status != "ok":
            raise RuntimeError(f"{self.label}: {code.splitlines()[:2]!r} failed:\n{reply.text[-3000:]}")
        return reply

    def result(self, code: str) -> dict[str, Any]:
        text = self._run(code).text
        line = next(ln for ln in text.splitlines() if "RESULT " in ln)
        return json.loads(line.split("RESULT ", 1)[1])

    def close(self) -> None:
        try:
            self.kernel.run("%clorch stop", timeout=120)
        finally:
            self.kernel.shutdown()


#: the sides --sides may name: what each adds to the notebook's environment
SIDES = {"forked": {"CLORCH_FORK_RANKS": "1"},
         "fresh": {"CLORCH_FORK_RANKS": "0"}}


def host_thp() -> str:
    out = []
    for name in ("enabled", "defrag", "khugepaged/max_ptes_shared", "khugepaged/pages_to_scan"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as fh:
                out.append(f"{name}={fh.read().strip()}")
        except OSError:
            out.append(f"{name}=?")
    return f"THP: {'; '.join(out)}; kernel {os.uname().release}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=0.4, help="each loop's length in a round")
    parser.add_argument("--loop", default="mlp", choices=("mlp", "python", "both"))
    parser.add_argument("--device", default="cpu", help="the MLP's device in rank 0 (cuda: the rank's GPU)")
    parser.add_argument("--start-args", default="--nproc 1 --backend gloo")
    parser.add_argument("--sides", default="forked,fresh",
                        help=f"comma-separated, of {', '.join(SIDES)}; ratios are against fresh")
    parser.add_argument("--instances", type=int, default=1,
                        help="start every side's notebook and rank anew this many times (--rounds each)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in every notebook's environment (repeatable)")
    args = parser.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    base = {"CLORCH_SPARES": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}
    loops = ["mlp", "python"] if args.loop == "both" else [args.loop]
    labels = args.sides.split(",")
    if "fresh" not in labels or any(label not in SIDES for label in labels):
        parser.error(f"--sides: fresh and any of {', '.join(SIDES)}")
    print(host_thp(), flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {k: {label: [] for label in labels} for k in loops}
    per_instance: list[dict[str, dict[str, float]]] = []
    sides: list[Side] = []
    try:
        for instance in range(args.instances):
            if instance:  # new notebooks, new ranks: a rank's own memory layout can differ by a few percent
                for side in sides:
                    side.close()
            sides = []
            for label in labels:
                sides.append(Side(label, dict(base, **SIDES[label]), args.start_args))
            first = {k: len(results[k]["fresh"]) for k in loops}
            for r in range(args.rounds):
                order = sides[r % len(sides):] + sides[:r % len(sides)]  # who goes first rotates
                for kind in loops:
                    for side in order:
                        results[kind][side.label].append(side.result(RUN.format(kind=kind, device=args.device,
                                                                                seconds=args.seconds)))
                    last = {s: rows[-1] for s, rows in results[kind].items()}
                    print(f"instance {instance} round {r} {kind}: " + "  ".join(
                        f"{s} {x['steps'] / x['wall']:.1f}/s ({x['cpu_us_best']:.1f} us CPU)" for s, x in last.items()),
                        flush=True)
            per_instance.append({kind: {label: statistics.median(
                g["cpu_us_best"] / f["cpu_us_best"] for f, g in zip(rows[first[kind]:], results[kind]["fresh"][first[kind]:]))
                for label, rows in results[kind].items() if label != "fresh"} for kind in loops})
            print(f"instance {instance}: speed/fresh by fastest-quarter CPU, median of its rounds: {per_instance[-1]}",
                  flush=True)
        for kind in loops:
            print(f"\n== {kind} loop, {args.instances} x {args.rounds} rounds (rank 0, device {args.device}) ==")
            for label, rows in results[kind].items():
                rates = [x["steps"] / x["wall"] for x in rows]
                print(f"{label:14s} steps/s {spread(rates)}  loop CPU us/step {spread([x['loop_cpu_us'] for x in rows])}"
                      f"  fastest quarter of blocks: wall us/step {spread([x['wall_us_best'] for x in rows])}"
                      f" CPU us/step {spread([x['cpu_us_best'] for x in rows])}\n{'':15s}"
                      f"minflt/step {spread([x['minflt'] for x in rows], '.3f')}"
                      f"  thread minflt/step {spread([x['thread_minflt'] for x in rows], '.3f')}"
                      f"  involuntary switches/step {spread([x['invol'] for x in rows], '.3f')}")
            fresh = results[kind]["fresh"]
            for label, rows in results[kind].items():
                if label == "fresh":
                    continue
                print(f"{label}/fresh, per round (median [min-max]):")
                ratios = [f["steps"] / f["wall"] / (g["steps"] / g["wall"]) for f, g in zip(rows, fresh)]
                print(f"  steps/s {spread(ratios, '.3f')}")
                for key, what in (("wall_us_best", "fastest-quarter wall"), ("cpu_us_best", "fastest-quarter CPU"),
                                  ("loop_cpu_us", "loop thread CPU")):
                    ratios = [g[key] / f[key] for f, g in zip(rows, fresh)]
                    print(f"  speed by {what} per step (fresh us / {label} us) {spread(ratios, '.3f')}")
                print(f"  by instance (fastest-quarter CPU): "
                      f"{spread([inst[kind][label] for inst in per_instance], '.3f')}")
        states = {s.label: s.result(STATE) for s in sides}  # the last instance's
        print("\n== rank 0's state after the loops ==")
        for k in states["fresh"]:
            if k == "env":
                continue
            values = {label: json.dumps(st.get(k)) for label, st in states.items()}
            if len(set(values.values())) == 1:
                print(f"{k:16s} same: {values['fresh']}")
            else:
                for i, (label, v) in enumerate(values.items()):
                    print(f"{k if i == 0 else '':16s} {label:14s} {v}")
        for label, st in states.items():
            if label == "fresh":
                continue
            env_a, env_b = st["env"], states["fresh"]["env"]
            diff = sorted(k for k in set(env_a) | set(env_b) if env_a.get(k) != env_b.get(k))
            print(f"env {label} vs fresh differs in:", {k: (env_a.get(k), env_b.get(k)) for k in diff} or "nothing")
    finally:
        for side in sides:
            side.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
