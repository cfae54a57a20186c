"""An ordinary Hugging Face Accelerate script, before slurm_resilience
(examples/accelerate_train.py is the same script after the change; docs/migration.md
shows the diff).

A tiny MLP on a synthetic regression set, a DataLoader with 2 workers, prepared by an
``Accelerator`` on CPU (gloo across processes). Deterministic: ``set_seed``, Accelerate's
seedable sampler (seed + epoch), dropout. Runs under torchrun, ``accelerate launch``
or srun (torchrun's variables); with ``--out final-{rank}.pt`` every rank writes its
final weights.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 32, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.randn(32, 4, generator=g)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--out", required=True, help="final weights; {rank} in it: one file per rank")
    args = ap.parse_args()

    torch.set_num_threads(1)
    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for epoch in range(args.epochs):
        for x, y in loader:
            time.sleep(args.step_time)  # emulated compute
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    torch.save(accelerator.unwrap_model(model).state_dict(), args.out.format(rank=accelerator.process_index))


if __name__ == "__main__":
    main()
