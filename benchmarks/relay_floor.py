"""How far the relay is from what no notebook-side change can go below (issue 39: an empty cell at
64 ranks within 2x a plain kernel's ``pass``).

    python benchmarks/relay_floor.py [--nprocs 64] [--cells 100] [--pairs 6]

Why: an empty cell at N ranks is the notebook's serial work (sign and send N requests, read,
check and book N replies) and the ranks' own work (each rank's kernel runs the cell; N of them on
the host's cores), which overlap only in part. Whether the 2x can come from the notebook's side
(fewer messages through it: one request a host, the replies gathered per host, the plan of the
earlier notes) depends on how much of the cell that side is. This measures it instead of
estimating it: in one session of N gloo ranks (driven in this process through the engine, as
``relay_cost.py`` does), blocks of empty cells run by the relay (``Session.run``) alternate with
blocks of *bare* cells: the same request, signed and sent to each rank by the relay's own
channels, and each rank's reply received with nothing else done (no signature check, no decoding,
no book-keeping, no liveness checks: what even a free gatherer could not take away), and blocks of
*checked* bare cells (the same, each reply's signature checked and decoded by the relay's decoder:
what a gatherer would still have to do somewhere). Printed: wall a cell of each, median [min-max]
over ``--pairs`` pairs of blocks (the order alternated pair by pair), the ratio to the relay of
each pair, the notebook's CPU a cell (this thread's), the relay's wait-loop passes a cell, and the
ranks' CPU a cell (all of them, every thread) with the host's core count, whose quotient is the
ranks' own floor if their work spread perfectly over the cores.

The bare cells bypass the relay's ledger; they ask nothing that leaves output (``pass`` sends no
iopub message on the lean path), so the relay's view of the ranks stays true. Each block of them is
followed by a relay cell whose success checks that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())  # the tree being measured (see relay_cost.py)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from relay_cost import CELL, Quiet, block, ranks_cpu  # noqa: E402

from clorch_repl.session.cell_request import packed_request  # noqa: E402
from clorch_repl.session.engine import local_session  # noqa: E402
from clorch_repl.session.protocol import CellRequest  # noqa: E402
from clorch_repl.wire.framing import utc_date  # noqa: E402


def bare_block(session, cells: int, check: bool) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(this thread's CPU seconds, wall seconds) of ``cells`` bare cells (see the module's
    docstring); ``check``: each reply's signature checked and decoded as the relay's read does."""
    channels = session.relay.channels
    ranks = sorted(channels.clients)
    request = CellRequest(CELL, tuple(ranks))
    metadata, content = packed_request(request, False, False, False, "a benchmark's bare cell")
    shells = [channels._shell[r] for r in ranks]  # noqa: SLF001 - a benchmark of the relay's floor
    decoders = [channels._decoders[r] for r in ranks]  # noqa: SLF001
    send = channels.send
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(cells):
        date = utc_date()
        for rank in ranks:
            send(rank, "execute_request", metadata, content, date)
        for sock, decoder in zip(shells, decoders):
            frame = sock.recv()
            if check:
                reply = decoder.decode([frame])
                if reply["content"].get("status") != "ok":
                    raise SystemExit(f"a bare cell failed: {reply['content']}")
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    if not session.run(CELL, None, None, Quiet()).ok:  # the relay's view is still true
        raise SystemExit("a relay cell after bare ones failed")
    return cpu, wall


def count_passes(session) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the relay's wait-loop passes from now on (the list's one number): each pass reads
    what has come, then does the cell's book-keeping (a flush, deadlines, prompts), so how many a
    cell takes says how much of that book-keeping the replies' trickle costs."""
    relay, passes = session.relay, [0]
    wait_once = relay._wait_once  # noqa: SLF001 - a benchmark of the relay's loop

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        passes[0] += 1
        return wait_once(*args, **kwargs)

    relay._wait_once = counted  # noqa: SLF001
    return passes


def spread(values: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    return (f"{statistics.median(values) * scale:{fmt}} "
            f"[{min(values) * scale:{fmt}}-{max(values) * scale:{fmt}}]")


def measure(n: int, cells: int, pairs: int) -> None:
    session = local_session(n, "gloo")
    session.start()
    try:
        pids = [pid for pid in session.pids() if pid]
        block(session, max(20, cells // 5))  # warm-up
        bare_block(session, max(20, cells // 5), True)
        walls: dict[str, list[float]] = {"relay": [], "bare": [], "checked": []}
        ranks_us: dict[str, list[float]] = {k: [] for k in walls}
        cpus: dict[str, list[float]] = {k: [] for k in walls}
        passes, relay_cells = count_passes(session), 0
        kinds = list(walls)
        for i in range(pairs):
            for kind in (kinds if i % 2 == 0 else kinds[::-1]):
                cpu0 = ranks_cpu(pids)
                if kind == "relay":
                    cpu, wall = block(session, cells)[:2]
                else:
                    cpu, wall = bare_block(session, cells, kind == "checked")
                walls[kind].append(wall / cells)
                cpus[kind].append(cpu / cells)
                relay_cells += cells if kind == "relay" else 1  # (a bare block ends with one relay cell)
                ranks_us[kind].append((ranks_cpu(pids) - cpu0) / cells)
        cores = len(os.sched_getaffinity(0))
        print(f"n={n} ({pairs} pairs of blocks of {cells} cells, {cores} cores, load {os.getloadavg()[0]:.1f}, "
              f"tree {os.getcwd()}):", flush=True)
        print(f"  the relay's wait-loop passes: {passes[0] / relay_cells:.1f} a cell", flush=True)
        for kind in kinds:
            ratio = "" if kind == "relay" else (
                "  / relay " + spread([b / r for b, r in zip(walls[kind], walls["relay"])], fmt=".3f"))
            ranks = statistics.median(ranks_us[kind])
            print(f"  {kind:>8}: wall {spread(walls[kind], 1e3)} ms a cell{ratio}; the notebook's CPU "
                  f"{statistics.median(cpus[kind]) * 1e3:.2f} ms a cell; the ranks' CPU "
                  f"{ranks * 1e3:.2f} ms a cell (over {cores} cores at best {ranks / cores * 1e3:.2f} ms)", flush=True)
    finally:
        session.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", default="64")
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args()
    for n in (int(x) for x in args.nprocs.split(",")):
        measure(n, args.cells, args.pairs)


if __name__ == "__main__":
    main()
