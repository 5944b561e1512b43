"""Ends with the exit its arguments ask for: ``exits.py STATUS [RANK_THAT_EXITS]``; ``none`` is
SystemExit(None), ``msg`` a message given to sys.exit, ``raise`` a ValueError from a function."""

import os
import sys

import torch.distributed as dist

what = sys.argv[1]
only = int(sys.argv[2]) if len(sys.argv) > 2 else None
rank = int(os.environ["RANK"])
print("before exit", flush=True)


def fail() -> None:
    raise ValueError(f"bad value on rank {rank}")


if only is None or only == rank:
    if what == "none":
        raise SystemExit(None)
    if what == "msg":
        sys.exit("cannot go on: no data")
    if what == "raise":
        fail()
    sys.exit(int(what))
print("after exit", flush=True)
