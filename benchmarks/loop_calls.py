"""The Python calls of the launch-bound loop, counted in a plain process and in a rank (issue 39:
is a rank's step slower because it runs more Python, or the same Python slower?).

    python benchmarks/loop_calls.py [--epochs 2] [--strategy ddp|fsdp]

Both sides run the example's ``train`` (``benchmarks.training.LAUNCH_LOOP``, one gloo rank on the
CPU) once to warm up, then under cProfile with one epoch and with ``1 + --epochs`` epochs; the
difference of the two profiles is what ``--epochs`` epochs of the loop call, without the set-up
that every ``train`` call repeats (the model, its DDP wrapper, the seeds). The plain side is a
``python -c`` process with the environment variables torchrun would set; the rank is a one-rank
local session through the engine, the same code in a cell. Counts, not timings: cProfile's
overhead is the same on both sides and does not enter. Printed: each side's calls a step, their
ratio (the plain process the baseline), and every function called a different number of times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROFILE = r'''
import cProfile, json, pstats, re, sys
sys.path.insert(0, {root!r})
from benchmarks.training import LAUNCH_LOOP
from clorch_repl.examples.distributed_training import train

def _counted(epochs):
    prof = cProfile.Profile()
    prof.enable()
    record = train(rank, world_size, device, dict(LAUNCH_LOOP, epochs=epochs, strategy={strategy!r}), log=lambda s: None)
    prof.disable()
    # a function's key without its address (a builtin's repr holds one) or this cell's file name
    return record, {{re.sub(" at 0x[0-9a-f]+", "", f"{{k[0]}}:{{k[1]}}:{{k[2]}}"): v[1]
                    for k, v in pstats.Stats(prof).stats.items() if "<string>" not in k[0] and "clorch_cells" not in k[0]}}

train(rank, world_size, device, dict(LAUNCH_LOOP, epochs=1, strategy={strategy!r}), log=lambda s: None)
_, _one = _counted(1)
_record, _more = _counted(1 + {epochs})
json.dump({{"steps": _record["global_step"] - _record["global_step"] // (1 + {epochs}),
           "calls": {{k: _more.get(k, 0) - _one.get(k, 0) for k in set(_one) | set(_more)}}}},
          open({out!r}, "w"))
'''


def plain(out: str, epochs: int, strategy: str) -> None:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    code = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
            "rank, world_size, device = 0, 1, torch.device('cpu')\n" + PROFILE.format(root=ROOT, out=out, epochs=epochs, strategy=strategy))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)


def in_rank(out: str, epochs: int, strategy: str) -> None:
    sys.path.insert(0, ROOT)
    from clorch_repl.session.engine import CellHooks, local_session

    session = local_session(1, "gloo")
    session.start()
    try:
        outcome = session.run(PROFILE.format(root=ROOT, out=out, epochs=epochs, strategy=strategy), [0], None, CellHooks())
        assert outcome.ok, outcome
    finally:
        session.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        for side, run in (("plain", plain), ("rank", in_rank)):
            path = os.path.join(tmp, f"{side}.json")
            run(path, args.epochs, args.strategy)
            with open(path) as fh:
                found[side] = json.load(fh)
    steps = {side: f["steps"] for side, f in found.items()}
    total = {side: sum(f["calls"].values()) for side, f in found.items()}
    print(f"{args.epochs} epoch(s) of the launch-bound loop ({args.strategy}): plain {total['plain']} Python calls over "
          f"{steps['plain']} steps ({total['plain'] / steps['plain']:.1f} a step), the rank {total['rank']} over "
          f"{steps['rank']} ({total['rank'] / steps['rank']:.1f} a step); ratio rank / plain "
          f"{(total['rank'] / steps['rank']) / (total['plain'] / steps['plain']):.4f}")
    plain_calls, rank_calls = found["plain"]["calls"], found["rank"]["calls"]
    differ = sorted((rank_calls.get(k, 0) - plain_calls.get(k, 0), k) for k in set(plain_calls) | set(rank_calls)
                    if rank_calls.get(k, 0) != plain_calls.get(k, 0))
    for delta, key in differ:
        print(f"  {delta:+d}  {key}  (plain {plain_calls.get(key, 0)}, rank {rank_calls.get(key, 0)})")
    if not differ:
        print("  every function was called as many times on both sides")


if __name__ == "__main__":
    main()
