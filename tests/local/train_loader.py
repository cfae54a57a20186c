"""train_mlp.py's model and state, fed by ResumableLoader with DataLoader workers and a
random augmentation in ``__getitem__`` (torch, random and numpy RNG): the worker
script of tests/local/test_local_loader.py."""

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from slurm_resilience import ResumableLoader, ResumableSampler, Session

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_mlp import make_data  # noqa: E402  (the same data as the other tier-3 runs)


class Jittered(Dataset):
    """(x + noise, y): the noise draws from all three global RNGs, as augmentations do."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        scale = 0.01 * (1 + random.random() + float(np.random.rand()))
        return self.x[i] + scale * torch.randn(self.x.shape[1]), self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.5)
    sampler = ResumableSampler(num_samples=len(x), per_rank_batch=args.batch, seed=0)

    with Session() as session, ResumableLoader(Jittered(x, y), sampler, num_workers=args.workers) as loader:
        session.register(model=model, optimizer=opt, scheduler=sched)
        session.extras.setdefault("lr_sum", 0.0)
        for step in session.steps(args.steps):
            with step:
                xb, yb = step.batch(loader)
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                session.all_reduce_gradients(model)
                opt.step()
                sched.step()
                session.extras["lr_sum"] += sched.get_last_lr()[0]
            time.sleep(args.step_time)


if __name__ == "__main__":
    main()
