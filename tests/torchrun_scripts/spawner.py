"""Starts its own ranks with torch.multiprocessing.spawn, as some DDP examples do."""

import sys

import torch.multiprocessing as mp


def worker(index: int, marker: str) -> None:
    with open(f"{marker}.{index}", "w") as fh:
        fh.write("started")


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
