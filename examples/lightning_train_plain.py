"""An ordinary PyTorch Lightning script, before slurm_resilience
(examples/lightning_train.py is the same script after the change; docs/migration.md
shows the diff).

A LightningModule (a tiny MLP) and a LightningDataModule whose DataLoader has 2
workers, trained by ``Trainer(strategy="ddp")`` on CPU with gloo. Deterministic:
``seed_everything``, Lightning's DistributedSampler (seed 0); dropout draws from
every rank's torch generator. Runs under
torchrun or srun (``devices``/``num_nodes`` from the launcher's variables); with
``--out final-{rank}.pt`` every rank writes its final weights.
"""

import argparse
import os
import time

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningDataModule):
    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(512, 32, generator=g)
        y = torch.tanh(x @ torch.randn(32, 4, generator=g))
        self.data = TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch, shuffle=True, num_workers=2)


class MLP(pl.LightningModule):
    def __init__(self, step_time: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 4))
        self.step_time = step_time

    def training_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(self.step_time)  # emulated compute
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--out", required=True, help="final weights; {rank} in it: one file per rank")
    args = ap.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=per_node, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node,
        strategy="ddp", max_epochs=args.epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = MLP(args.step_time)
    trainer.fit(model, datamodule=Regression(args.batch))
    torch.save(model.state_dict(), args.out.format(rank=trainer.global_rank))


if __name__ == "__main__":
    main()
