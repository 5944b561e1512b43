"""pytorch/examples' DDP tutorial (distributed/ddp-tutorial-series/multigpu_torchrun.py) as people
copy it: the device is ``LOCAL_RANK``'s (``torch.cuda.set_device(local_rank)``, ``.to(local_rank)``,
``device_ids=[local_rank]``), on the CPU where there is no GPU. Prints each rank's device and the
trained weights, which torchrun and ``%clorch run`` must agree on.

    torchrun --nproc-per-node 2 ddp_tutorial.py 3
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> int:
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        init_process_group(backend="nccl", device_id=torch.device(f"cuda:{local_rank}"))
    else:
        init_process_group(backend="gloo")
    return local_rank


def main(epochs: int) -> None:
    local_rank = ddp_setup()
    gpu = torch.cuda.is_available()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 20), torch.randn(64, 1))
    model = torch.nn.Linear(20, 1)
    model = model.to(local_rank) if gpu else model
    model = DDP(model, device_ids=[local_rank] if gpu else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=8, shuffle=False, sampler=DistributedSampler(data))
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            if gpu:
                source, targets = source.to(local_rank), targets.to(local_rank)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(source), targets).backward()
            optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    here = torch.empty(0).to(local_rank).device if gpu else torch.device("cpu")
    print(f"rank {dist.get_rank()} local {local_rank} device {here} "
          f"current {torch.cuda.current_device() if gpu else '-'} weights {weights.sum().item():.6f}")
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
