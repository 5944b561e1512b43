"""Collectives through clorch_repl beside raw torch.distributed, same tensors, same run.

    python benchmarks/collectives.py                     # 2 gloo ranks on CPU, or every GPU with NCCL
    python benchmarks/collectives.py --backend nccl --sizes 4K,1M,64M,1G --iters 50

Ranks are started with ``clorch_repl.distributed.launch`` itself. For every size and collective,
rank 0 times blocks of calls of each path, alternating raw/clorch blocks for several rounds, and
reports the median per-call time of each, their ratio and the absolute microseconds clorch adds.
Emulated ops (avg on gloo, bitwise ops on NCCL, or any of them forced with ``dist.emulate``) get
their own rows beside the native op they stand in for. all_reduce rows also show bus bandwidth
(busbw = algbw x 2(n-1)/n) for both paths. Target: at most 2% slower from 1 MB up, at most 20 us
added below.

Sizes: per-rank tensor bytes for all_reduce/broadcast/reduce/all_to_all, the gathered output for
all_gather, the input for reduce_scatter (the nccl-tests convention).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

MODULE = os.path.splitext(os.path.basename(__file__))[0]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# rank side


def _cases(world: int, kind: str, native_avg: bool) -> list[tuple[str, str, Callable[..., Any], Callable[..., Any],
                                                              Callable[[int, Any], Any], list[str] | None]]:
    """(name, note, raw(t...), clorch(t...), make(numel, device) -> tensors, ops to emulate)."""
    import torch
    import torch.distributed as tdist

    from clorch_repl import distributed as dist
    from clorch_repl.distributed.collectives import _all_gather_single, _reduce_scatter_single

    R = tdist.ReduceOp

    def floats(numel: int, device: Any) -> tuple[Any, ...]:
        return (torch.ones(numel, device=device),)

    def ints(numel: int, device: Any) -> tuple[Any, ...]:
        return (torch.full((numel,), 7, dtype=torch.int32, device=device),)

    def pair(out_numel: int, in_numel: int) -> Callable[[int, Any], tuple[Any, ...]]:
        def make(numel: int, device: Any) -> tuple[Any, ...]:
            return (torch.empty(out_numel(numel) if callable(out_numel) else out_numel, device=device),
                    torch.ones(in_numel(numel) if callable(in_numel) else in_numel, device=device))
        return make

    def raw_avg(t: Any) -> None:
        if native_avg:
            tdist.all_reduce(t, op=R.AVG)
        else:  # what a torch user has to write on gloo without AVG
            tdist.all_reduce(t, op=R.SUM)
            t.div_(world)

    cases = [
        ("all_reduce sum", "", lambda t: tdist.all_reduce(t, op=R.SUM), lambda t: dist.all_reduce(t, "sum"),
         floats, None),
        ("all_reduce avg", "" if (kind == "nccl") else "emulated: sum+div", raw_avg,
         lambda t: dist.all_reduce(t, "avg"), floats, None),
        ("broadcast", "", lambda t: tdist.broadcast(t, 0), lambda t: dist.broadcast(t, root=0), floats, None),
        ("reduce sum", "", lambda t: tdist.reduce(t, 0, op=R.SUM), lambda t: dist.reduce(t, "sum", root=0), floats,
         None),
        ("all_gather_into", "", lambda o, i: _all_gather_single(o, i), lambda o, i: dist.all_gather_into(o, i),
         pair(lambda n: n, lambda n: n // world), None),
        ("reduce_scatter_into", "", lambda o, i: _reduce_scatter_single(o, i, op=R.SUM),
         lambda o, i: dist.reduce_scatter_into(o, i, "sum"), pair(lambda n: n // world, lambda n: n), None),
        ("all_to_all_single", "", lambda o, i: tdist.all_to_all_single(o, i),
         lambda o, i: dist.all_to_all_single(o, i), pair(lambda n: n, lambda n: n), None),
    ]
    if kind == "nccl":
        # No native bitwise op: compare with a native all_reduce of the same bytes.
        cases.append(("all_reduce band", "emulated: gather+fold; raw=sum", lambda t: tdist.all_reduce(t, op=R.SUM),
                      lambda t: dist.all_reduce(t, "band"), ints, None))
    else:
        cases.append(("all_reduce band", "", lambda t: tdist.all_reduce(t, op=R.BAND),
                      lambda t: dist.all_reduce(t, "band"), ints, None))
        cases.append(("all_reduce band", "forced emulation: gather+fold", lambda t: tdist.all_reduce(t, op=R.BAND),
                      lambda t: dist.all_reduce(t, "band"), ints, ["band"]))
    return cases


def _time_block(fn: Callable[..., Any], tensors: tuple[Any, ...], iters: int, sync: Callable[[], None],
                barrier: Callable[[], None]) -> float:
    barrier()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn(*tensors)
    sync()
    return (time.perf_counter() - start) / iters


def bench_worker(ctx: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as tdist

    from clorch_repl import distributed as dist

    args = ctx["args"]
    world, kind = ctx["world_size"], ctx["backend"]
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if kind == "nccl" else (lambda: None)
    barrier = tdist.barrier
    native_avg = True
    if kind != "nccl":
        try:
            tdist.all_reduce(torch.ones(1), op=tdist.ReduceOp.AVG)
        except RuntimeError:
            native_avg = False
    rows = []
    for size in args["sizes"]:
        numel = max(world, size // 4)
        numel -= numel % world
        iters = max(args["min_iters"], min(args["iters"], int(args["budget_mb"] * MB // max(size, 1))))
        for name, note, raw, ours, make, emulated in _cases(world, kind, native_avg):
            tensors = make(numel, device)
            for _ in range(args["warmup"]):
                raw(*tensors)
            dist.emulate(emulated)
            try:
                for _ in range(args["warmup"]):
                    ours(*tensors)
                raw_times, our_times = [], []
                for _ in range(args["rounds"]):
                    dist.emulate(None)
                    raw_times.append(_time_block(raw, tensors, iters, sync, barrier))
                    dist.emulate(emulated)
                    our_times.append(_time_block(ours, tensors, iters, sync, barrier))
            finally:
                dist.emulate(None)
            rows.append({"size": size, "op": name, "note": note, "iters": iters,
                         "raw_us": statistics.median(raw_times) * 1e6, "ours_us": statistics.median(our_times) * 1e6})
            del tensors
    overhead = _wrapper_overhead(ctx, args["overhead_iters"]) if args["overhead_iters"] else []
    return {"rows": rows, "overhead": overhead} if ctx["rank"] == 0 else None


def _wrapper_overhead(ctx: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    """The wrapper's own cost, without network noise: each rank times calls on a one-rank group
    of its own, 4 KB tensors, alternating raw/clorch blocks."""
    import torch
    import torch.distributed as tdist

    from clorch_repl import distributed as dist

    world = ctx["world_size"]
    solos = [tdist.new_group([r]) for r in range(world)]  # every rank creates every group
    solo = solos[ctx["rank"]]
    on_gpu = ctx["backend"] == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    R = tdist.ReduceOp
    t = torch.ones(1024, device=device)
    out = torch.empty(1024, device=device)
    pairs = [
        ("all_reduce sum", lambda: tdist.all_reduce(t, op=R.SUM, group=solo),
         lambda: dist.all_reduce(t, "sum", group=solo)),
        ("all_reduce sum async", lambda: tdist.all_reduce(t, op=R.SUM, group=solo, async_op=True).wait(),
         lambda: dist.all_reduce(t, "sum", group=solo, async_op=True).wait()),
        ("broadcast", lambda: tdist.broadcast(t, ctx["rank"], group=solo),
         lambda: dist.broadcast(t, root=ctx["rank"], group=solo)),
        ("all_to_all_single", lambda: tdist.all_to_all_single(out, t, group=solo),
         lambda: dist.all_to_all_single(out, t, group=solo)),
    ]
    result = []
    for name, raw, ours in pairs:
        for fn in (raw, ours, raw, ours):
            fn()
        raw_t, our_t = [], []
        for _ in range(7):
            for times, fn in ((raw_t, raw), (our_t, ours)):
                sync()
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync()
                times.append((time.perf_counter() - start) / iters * 1e6)
        result.append({"op": name, "raw_us": statistics.median(raw_t), "ours_us": statistics.median(our_t)})
    tdist.barrier()
    return result


# ---------------------------------------------------------------------------------------------
# parent side


def print_table(rows: list[dict[str, Any]], world: int, backend: str) -> None:
    head = (f"{'size':>6}  {'collective':<20} {'raw us':>11} {'clorch us':>11} {'ratio':>7} {'added us':>9}"
            f"  {'busbw raw/clorch GB/s':>22}  {'target':<6} note")
    print(head)
    print("-" * len(head))
    for row in rows:
        raw, ours = row["raw_us"], row["ours_us"]
        added = ours - raw
        ratio = ours / raw if raw else float("nan")
        bw = ""
        if row["op"].startswith("all_reduce sum"):
            factor = 2 * (world - 1) / world
            bw = f"{row['size'] / raw / 1e3 * factor:.2f} / {row['size'] / ours / 1e3 * factor:.2f}"
        emulated = bool(row["note"])
        if emulated:
            target = "-"
        elif row["size"] >= MB:
            target = "ok" if ratio <= 1.02 else "MISS"
        else:
            target = "ok" if added <= 20 else "MISS"
        print(f"{human(row['size']):>6}  {row['op']:<20} {raw:11.1f} {ours:11.1f} {ratio:7.3f} {added:9.1f}"
              f"  {bw:>22}  {target:<6} {row['note']}")
    print(f"\n{world} ranks, backend {backend}. ratio = clorch/raw (median of rounds); added = clorch - raw "
          "per call. Emulated rows compare the emulation with the native op it replaces (target '-').")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated sizes, e.g. 4K,1M,1G")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with GPUs, else gloo)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU, or 2 on CPU)")
    parser.add_argument("--devices", default=None, help="GPUs, e.g. 0,1")
    parser.add_argument("--iters", type=int, default=50, help="calls per timed block (fewer for big sizes)")
    parser.add_argument("--min-iters", type=int, default=3)
    parser.add_argument("--budget-mb", type=float, default=512.0,
                        help="cap on bytes per timed block: iters = min(iters, budget / size)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating raw/clorch blocks per case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--overhead-iters", type=int, default=2000,
                        help="calls per block of the no-network wrapper-cost measurement (0: skip it)")
    opts = parser.parse_args(argv)

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    for path in (root, here):
        if path not in sys.path:
            sys.path.insert(0, path)
    from clorch_repl import distributed as dist

    sizes = [parse_size(s) for s in opts.sizes.split(",") if s.strip()]
    if any(s > (1 << 30) for s in sizes):
        parser.error("sizes above 1G are refused (each rank holds a few tensors of that size)")
    job = dist.launch(nproc_per_node=opts.nproc, devices=opts.devices, main=f"{MODULE}:bench_worker",
                      backend=opts.backend, timeout_ms=opts.timeout_s * 1000,
                      args={"sizes": sizes, "iters": opts.iters, "min_iters": opts.min_iters,
                            "budget_mb": opts.budget_mb, "rounds": opts.rounds, "warmup": opts.warmup,
                            "overhead_iters": opts.overhead_iters})
    with job:
        results = job.wait()
    status = job.status()
    print_table(results[0]["rows"], status.nproc, status.backend)
    if results[0]["overhead"]:
        print("\nWrapper cost per call on a one-rank group (no network; 4 KB tensor; median of 7 blocks):")
        for row in results[0]["overhead"]:
            print(f"  {row['op']:<22} raw {row['raw_us']:8.2f} us   clorch {row['ours_us']:8.2f} us   "
                  f"added {row['ours_us'] - row['raw_us']:6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
