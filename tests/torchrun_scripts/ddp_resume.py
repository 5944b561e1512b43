"""Train a small regression model with DDP for a number of epochs, resuming from rank 0's
snapshot when there is one: a torchrun script as people write them (argparse, init and destroy
of the process group, a DistributedSampler, rank 0 saving).

    torchrun --nproc-per-node 2 ddp_resume.py --epochs 2 --snapshot /tmp/snap.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="DDP with a rank-0 snapshot")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else local_rank) if backend == "nccl" else torch.device("cpu")

    torch.manual_seed(1234)
    model = torch.nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, map_location=device, weights_only=True)
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        start = snap["epoch"] + 1
        print(f"resumed from epoch {snap['epoch']}")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        total, seen = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(x), seen + len(x)
        print(f"epoch {epoch} rank {rank} samples {seen} loss {total / seen:.6f}")
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       args.snapshot)
            print(f"snapshot at epoch {epoch}")
        dist.barrier()

    weights = model.weight.detach().flatten().tolist()
    print("weights", " ".join(f"{w:.6f}" for w in weights))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
