"""A Lightning Fabric script as its docs write it, with strategy="ddp": under torchrun Fabric
finds torchrun's variables and joins the group (no processes of its own). Prints the trained
weights per rank, which torchrun and ``%clorch run`` must agree on.

    torchrun --nproc-per-node 2 lightning_fabric.py [ACCELERATOR [STRATEGY]]   (default: cpu ddp)
"""

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def main(accelerator: str = "cpu", strategy: str = "ddp") -> None:
    fabric = L.Fabric(accelerator=accelerator, devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")), strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 1))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))
    for _ in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
    total = sum(p.detach().float().sum() for p in model.parameters())
    if strategy == "fsdp":  # each rank holds a shard: the whole model's sum is the ranks' sum
        total = fabric.all_reduce(total, reduce_op="sum")
    print(f"fabric rank {fabric.global_rank} of {fabric.world_size} local {fabric.local_rank} "
          f"on {fabric.device} weights {total.item():.6f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
