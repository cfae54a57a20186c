"""The MLP of train_mlp.py with ZeRO-1-style sharded optimizer state (CPU, gloo).

Parameters are replicated; the momentum buffer is sharded: rank r owns the slice
``shard_range(total, world, r)`` of the flat parameter vector, updates that slice
and the ranks exchange updated slices (an all-reduce of disjoint slices, which is
exact: x + 0 = x). On a recovery the toolkit restores every slice from the newest
complete checkpoint, resharded to the new world size.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from slurm_resilience import ResumableSampler, Session, shard_range

from train_mlp import make_data


class ShardedMomentumSGD:
    """SGD with momentum whose momentum buffer is sharded over the ranks."""

    def __init__(self, params, session: Session, lr: float, momentum: float) -> None:
        self.params, self.session, self.lr, self.momentum = list(params), session, lr, momentum
        self.buf: torch.Tensor | None = None

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def step(self) -> None:
        s = self.session
        grad = torch.cat([p.grad.reshape(-1) for p in self.params])  # already averaged
        a, b = shard_range(grad.numel(), s.world_size, s.rank)
        if self.buf is None or self.buf.numel() != b - a:
            self.buf = torch.zeros(b - a)
        self.buf.mul_(self.momentum).add_(grad[a:b])
        full = torch.zeros_like(grad)
        full[a:b] = self._flat()[a:b] - self.lr * self.buf
        s.all_reduce(full)  # disjoint slices: every rank gets the exact updated vector
        off = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[off:off + p.numel()].view_as(p))
                off += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        n = sum(p.numel() for p in self.params)
        a, b = shard_range(n, self.session.world_size, self.session.rank)
        buf = self.buf if self.buf is not None and self.buf.numel() == b - a else torch.zeros(b - a)
        return {"shards": {"momentum": buf.clone()}, "lr": self.lr, "momentum": self.momentum}

    def load_state_dict(self, sd: dict) -> None:
        self.buf = sd["shards"]["momentum"].clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--step-time", type=float, default=0.05)
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    sampler = ResumableSampler(num_samples=len(x), per_rank_batch=args.batch, seed=0)

    with Session() as session:
        opt = ShardedMomentumSGD(model.parameters(), session, lr=0.05, momentum=0.9)
        session.register(model=model)
        session.register_sharded(optimizer=opt)
        for step in session.steps(args.steps):
            with step:
                idx = step.samples(sampler)
                opt.zero_grad()
                F.mse_loss(model(x[idx]), y[idx]).backward()
                session.all_reduce_gradients(model)
                opt.step()
            time.sleep(args.step_time)


if __name__ == "__main__":
    main()
