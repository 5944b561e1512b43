"""How a cold ``%clorch start`` grows with the rank count (issue 39), beside baselines of the same run.

    python benchmarks/start_scale.py [--nprocs 4,8,16] [--repeats 3] [--iters 100]

For each rank count N, in one notebook kernel (``CLORCH_SPARES=0``: cold starts), alternating
start by start so that a shared machine's load falls on both alike:

* ``%clorch start --nproc N --backend gloo`` until the group has formed, with the ranks forked
  from the session's zygote (``CLORCH_FORK_RANKS=1``, the default) and as fresh interpreters
  (``CLORCH_FORK_RANKS=0``, the way before);
* the baselines: N plain ipykernels started at once by jupyter_client until each answers
  ``kernel_info`` (no torch, no group), and ``torchrun`` starting N gloo ranks (init, barrier, exit);
* an empty ``%%distributed`` cell at N ranks beside ``pass`` in the same notebook kernel and
  ``pass`` in a plain kernel (an ipykernel that never loaded clorch_repl, started alike), the three
  interleaved in a random order each round, after a forked start; and the relay alone,
  ``Session.run("pass")`` timed inside the notebook kernel (no magic, no output to the client,
  no round trip to it), which splits the cell's time between the relay with the ranks and the
  layers above it.

Prints medians with [min-max] over ``--repeats`` and the 1-minute load average when each rank
count began. Targets (issue 39, on the 16-core device): 64 ranks formed within 10 s; an empty
cell at 64 within 2x a plain kernel's. The plain kernel is the target's baseline; the notebook
kernel's own ``pass`` (clorch_repl loaded, its ranks idle; all that this benchmark printed before
2026-12-06) is printed beside it. The two differed by a few percent either way where measured
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from queue import Empty

from jupyter_client import KernelManager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cell_latency import CELL, percentiles, round_trip, timed, torchrun_start  # noqa: E402
from notebook_kernel import NotebookKernel  # noqa: E402  (cell_latency put tests/ on the path)

MODES = {"forked": "1", "fresh interpreters": "0"}
#: In the notebook kernel, alternated: the session's own run of an empty cell, and the magic's
#: (``run_cell_magic``: the magic's layer without the kernel's execute request), timed there
RELAY_ALONE = """
import statistics as _st, time as _time
from clorch_repl.magics import magics_for as _magics_for
from clorch_repl.session.engine import CellHooks as _CellHooks
_ip = get_ipython()
_session, _hooks, _relay, _magic = _magics_for(_ip).session, _CellHooks(), [], []
for _ in range({iters}):
    _t0 = _time.perf_counter()
    assert _session.run("pass", None, None, _hooks).ok
    _t1 = _time.perf_counter()
    _ip.run_cell_magic("distributed", "", "pass")
    _relay.append(_t1 - _t0)
    _magic.append(_time.perf_counter() - _t1)
_show = lambda t: f"p50 {{_st.median(t) * 1e3:.2f}} ms, p90 {{_st.quantiles(t, n=10)[8] * 1e3:.2f}} ms"
print(f"{{_show(_relay)}}; the magic alone (run_cell_magic in the notebook kernel) {{_show(_magic)}}")
"""


def plain_kernels(n: int) -> float:
    """Seconds until N plain ipykernels started at once all answer kernel_info."""
    t0 = time.perf_counter()
    # IPC sockets, as the ranks have: with TCP, 64 kernels started at once raced for the ports
    # jupyter_client had picked for them (the device: "Address already in use", a kernel died)
    folder = tempfile.mkdtemp(prefix="clorch-plain-")
    managers = [KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, f"k{i}"))
                for i in range(n)]
    try:
        for km in managers:
            km.start_kernel()
        clients = [km.client() for km in managers]
        for client in clients:
            client.start_channels()
        for client in clients:
            client.wait_for_ready(timeout=300)
        elapsed = time.perf_counter() - t0
        for client in clients:
            client.stop_channels()
        return elapsed
    finally:
        for km in managers:
            try:
                km.shutdown_kernel(now=True)
            except (RuntimeError, Empty) as exc:
                print(f"  (a plain kernel did not shut down cleanly: {exc})")
        shutil.rmtree(folder, ignore_errors=True)


def three_way(nb: NotebookKernel, plain: NotebookKernel, iters: int) -> dict[str, list[float]]:
    """``iters`` rounds of the empty cell, ``pass`` in ``nb`` and ``pass`` in ``plain``, each round
    in a random order (after a warm-up of each); seconds, by name."""
    runs = {"cell": (nb, CELL), "pass": (nb, "pass"), "plain pass": (plain, "pass")}
    for _ in range(max(5, iters // 10)):
        for kernel, code in runs.values():
            timed(kernel, code)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name in random.sample(list(runs), len(runs)):
            samples[name].append(timed(*runs[name]))
    return samples


def spread(samples: list[float]) -> str:
    return f"{statistics.median(samples):6.2f} s [{min(samples):.2f}-{max(samples):.2f}]"


def clorch_start(nb: NotebookKernel, n: int, fork: str) -> float:
    assert nb.run(f"%env CLORCH_FORK_RANKS={fork}").status == "ok"
    elapsed, status = round_trip(nb, f"%clorch start --nproc {n} --backend gloo")
    assert status == "ok", f"%clorch start --nproc {n} (CLORCH_FORK_RANKS={fork}) failed"
    return elapsed


def profiled_start(nb: NotebookKernel, n: int, lines: int) -> None:
    """Where a forked start's time goes, as the notebook kernel sees it (issue 39: the device's 64
    ranks took 10 s where the 2-core box's took 5.8 s, and no probe had run there)."""
    assert nb.run("%env CLORCH_FORK_RANKS=1").status == "ok"
    # jupyter_client starts each kernel on a thread of its own (jupyter_core's run_sync under a
    # running loop), which cProfile does not see: the zygote's fork round trips and each rank's
    # whole launch are timed by wrappers around them instead
    code = ("import cProfile as _cp, pstats as _ps, io as _io, time as _t, statistics as _st\n"
            "from clorch_repl.launchers import forked as _f, local as _l\n_took = {'fork': [], 'launch': []}\n"
            "def _timing(cls, name, key):\n    orig = getattr(cls, name)\n"
            "    def timed(*a, **k):\n        t0 = _t.perf_counter()\n        try:\n            return orig(*a, **k)\n"
            "        finally:\n            _took[key].append(_t.perf_counter() - t0)\n"
            "    setattr(cls, name, timed)\n    return orig\n"
            "_orig = [_timing(_f.Zygote, 'fork', 'fork'), _timing(_l.LocalLauncher, '_start_kernel', 'launch')]\n"
            "_p = _cp.Profile()\n_p.enable()\n"
            f"get_ipython().run_line_magic('clorch', 'start --nproc {n} --backend gloo')\n_p.disable()\n"
            "_f.Zygote.fork, _l.LocalLauncher._start_kernel = _orig\n"
            "for _k, _v in _took.items():\n"
            "    print(f'{_k}: {len(_v)} calls, {sum(_v):.2f} s in all, the first {_v[0]:.3f} s, '\n"
            "          f'the others median {_st.median(_v[1:] or _v) * 1e3:.1f} ms [{min(_v[1:] or _v) * 1e3:.1f}-'\n"
            "          f'{max(_v[1:] or _v) * 1e3:.1f}]')\n"
            "_o = _io.StringIO()\n_ps.Stats(_p, stream=_o).sort_stats('cumulative').print_stats("
            f"{lines})\nprint(_o.getvalue())\ndel _cp, _ps, _io, _p, _o, _took, _orig, _timing")
    reply = nb.run(code, timeout=600)
    print(f"{n} ranks, one forked start under cProfile (wall time, cumulative):")
    print("\n".join("    " + line for line in reply.text.splitlines() if line.strip()))
    nb.run("%clorch stop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="4,8,16")
    parser.add_argument("--repeats", type=int, default=3, help="starts per mode and baseline, per rank count")
    parser.add_argument("--iters", type=int, default=100,
                        help="rounds of the empty cell, the notebook kernel's pass and a plain kernel's pass (0: none)")
    parser.add_argument("--fresh-max", type=int, default=10**6,
                        help="time fresh interpreters and torchrun (each rank imports torch: about 0.3 GB a "
                             "rank) only up to this many ranks")
    parser.add_argument("--profile", type=int, default=0, metavar="LINES",
                        help="first, one forked start of each rank count under cProfile in the notebook kernel "
                             "(wall time: waits show as the calls that waited), its LINES costliest calls by "
                             "cumulative time; not counted in the figures")
    args = parser.parse_args()
    quiet = {"CLORCH_SPARES": "0", "CLORCH_KEEP_LOGS": "0"}  # (cold starts; no kept logs left in /tmp per start)
    nb = NotebookKernel(env=quiet)
    plain: NotebookKernel | None = None
    try:
        plain = NotebookKernel(env=quiet) if args.iters else None  # the cell's baseline
        assert nb.run("%load_ext clorch_repl").status == "ok"
        for n in (int(x) for x in args.nprocs.split(",")):
            load = os.getloadavg()[0]
            heavy = n <= args.fresh_max
            times: dict[str, list[float]] = {name: [] for name in [*MODES, "plain ipykernels", "torchrun"]
                                             if heavy or name in ("forked", "plain ipykernels")}
            if args.profile:
                profiled_start(nb, n, args.profile)
            for _ in range(args.repeats):
                for name, fork in MODES.items():
                    if name in times:
                        times[name].append(clorch_start(nb, n, fork))
                        nb.run("%clorch stop")
                try:
                    times["plain ipykernels"].append(plain_kernels(n))
                except RuntimeError as exc:  # a baseline that failed: say so, and keep the rest
                    print(f"  (plain ipykernels, {n} at once, failed: {exc})")
                if heavy:
                    times["torchrun"].append(torchrun_start(n, "gloo"))
            print(f"{n} ranks (load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end):")
            for name, samples in times.items():
                if not samples:
                    continue
                label = f"%clorch start, {name}" if name in MODES else name
                print(f"  {label:<38} {spread(samples)}")
            if args.iters:
                clorch_start(nb, n, "1")
                assert plain is not None
                timings = three_way(nb, plain, args.iters)
                c50, p50, b50 = (percentiles(timings[name])[0] for name in ("cell", "plain pass", "pass"))
                print(f"  empty cell p50 {c50:.2f} ms, plain kernel's pass {p50:.2f} ms: {c50 / p50:.2f}x "
                      f"(this notebook kernel's own pass {b50:.2f} ms: {c50 / b50:.2f}x)")
                relay = nb.run(RELAY_ALONE.format(iters=args.iters)).text.strip().splitlines()[-1]
                print(f"  the relay alone (Session.run('pass') in the notebook kernel): {relay}")
                nb.run("%clorch stop")
            sys.stdout.flush()
    finally:
        nb.shutdown()
        if plain is not None:
            plain.shutdown()


if __name__ == "__main__":
    main()
