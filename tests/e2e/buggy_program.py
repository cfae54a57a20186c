"""A tiny Session program with a bug of its own (issue 22's e2e): not a fault of any node.

--broken-state: a registered object's state_dict() raises at the first state sync on
every rank (like a restore of another model's state: ``Error(s) in loading state_dict``).
--raise-at N: rank 1 raises at step N in every generation (a data-dependent bug: it
comes back after each recovery at the same step).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from slurm_resilience import Session


class Broken:
    def state_dict(self):
        raise RuntimeError("Error(s) in loading state_dict for Linear: Missing key(s) in state_dict: \"0.weight\"")

    def load_state_dict(self, state):
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--broken-state", action="store_true")
    ap.add_argument("--raise-at", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    with Session() as session:
        session.register(model=model, optimizer=opt)
        if args.broken_state:
            session.register(extra=Broken())
        for step in session.steps(args.steps):
            with step:
                if session.rank == 1 and step.index == args.raise_at:
                    raise ValueError(f"bad sample at step {step.index}: label out of range")
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                session.all_reduce_gradients(model)
                opt.step()
            time.sleep(args.step_time)


if __name__ == "__main__":
    main()
