"""A Lightning Fabric script as its docs write it, with strategy="ddp": under torchrun Fabric
finds torchrun's variables and joins the group (no processes of its own). Prints the trained
weights per rank, which torchrun and ``%clorch run`` must agree on.

    torchrun --nproc-per-node 2 lightning_fabric.py
"""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
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
    total = sum(p.detach().sum() for p in model.parameters())
    print(f"fabric rank {fabric.global_rank} of {fabric.world_size} local {fabric.local_rank} "
          f"weights {total.item():.6f}")


if __name__ == "__main__":
    main()
