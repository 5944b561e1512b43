"""A Lightning Trainer script with strategy="ddp": under torchrun the Trainer finds torchrun's
variables and joins the group. Prints the trained weights per rank, which torchrun and
``%clorch run`` must agree on.

    torchrun --nproc-per-node 2 lightning_trainer.py ROOT_DIR
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(root: str) -> None:
    L.seed_everything(11)
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 1))
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root)
    trainer.fit(model, DataLoader(data, batch_size=8))
    total = sum(p.detach().sum() for p in model.parameters())
    print(f"trainer rank {trainer.global_rank} of {trainer.world_size} local {trainer.local_rank} "
          f"weights {total.item():.6f}")


if __name__ == "__main__":
    main(sys.argv[1])
