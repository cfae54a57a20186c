"""An ordinary DDP training script, before slurm_resilience (examples/train_ddp.py is
the same script after the change; docs/migration.md shows the diff).

Map-style dataset with a random augmentation, DataLoader workers, LR scheduler, AMP
(bf16 autocast on CPU) with a GradScaler, gradient accumulation with ``no_sync()``,
an eval every N steps (all-reduced loss) and rank-0 logging. Runs under
``torchrun --standalone --nproc-per-node 2 examples/train_ddp_plain.py``.
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Regression(Dataset):
    """Map-style: a fixed random regression problem; each read adds augmentation noise."""

    def __init__(self, n: int = 2048, d_in: int = 16, d_out: int = 4, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d_in, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(d_in, d_out, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(self.x.shape[1]), self.y[i]  # random augmentation


def batches(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (emulated compute)")
    ap.add_argument("--out", default=".", help="where each rank's final state goes")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    data, evaluation = Regression(), Regression(n=256, seed=99)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    scaler = torch.amp.GradScaler(device)

    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        pass  # e.g. wandb.init(project=...)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model.to(device)
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=2, drop_last=True)
    stream = batches(loader, sampler)
    for index in range(args.steps):
        if index and index % args.eval_every == 0:  # eval the model of the step before
            model.eval()
            with torch.no_grad():
                mine = evaluation.x[rank::world_size].to(device)
                want = evaluation.y[rank::world_size].to(device)
                total = torch.stack([F.mse_loss(model(mine), want, reduction="sum"),
                                     torch.tensor(float(want.numel()), device=device)])
                dist.all_reduce(total)
            model.train()
            if rank == 0:
                print(f"after step {index - 1} eval loss {total[0] / total[1]:.5f}", flush=True)
        x, y = next(stream)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        for i, (xs, ys) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
            last = i == args.accum - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():  # all-reduce once
                with torch.autocast(device, dtype=amp_dtype):
                    loss = F.mse_loss(ddp(xs), ys) / args.accum
                scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if rank == 0 and index % 10 == 0:
            print(f"step {index} loss {loss.item() * args.accum:.5f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
    stream.close()  # stop the DataLoader workers now, not in the interpreter's shutdown
    final = {"step": args.steps, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "rng": torch.get_rng_state()}
    os.makedirs(args.out, exist_ok=True)
    torch.save(final, os.path.join(args.out, f"final-rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
