"""An ordinary torchrun-style training script: no slurm_resilience import at all.

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (set by torchrun,
or by ``slurm-resilience run``), trains a small deterministic MLP data-parallel on
gloo, saves its own snapshot every 10 steps and resumes from it when relaunched.
Runs the same with one rank per node or G per node (``torchrun --nproc_per_node=G``,
``slurm-resilience run --tasks-per-node G``). ``--out final.pt`` is rank 0's final
state; ``--out final-{rank}.pt`` has every rank write its own, with the torchrun
variables it ran under, so each rank's end state can be checked.
Deterministic by construction: data chosen by global sample index, one flat SUM
all-reduce of the gradients, one thread; so a relaunched run ends with the same
bits as one that never failed. After each step rank 0 appends ``STEP UNIX_TIME`` to
``SR_PROGRESS_FILE`` when that is set: the supervisor times a recovery to the first
step that way (docs/restart.md, "Recovery lines and phases").
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SNAPSHOT_EVERY = 10


def make_data(n: int = 4096, d_in: int = 32, d_out: int = 4):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return x, y


def save_atomic(obj, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--step-time", type=float, default=0.1, help="extra seconds per step (emulated compute)")
    ap.add_argument("--ckpt", required=True, help="directory of the snapshot (shared by all ranks)")
    ap.add_argument("--stamps", help="rank 0 appends `SR_RESTART step unix-time` after every step (benchmarks)")
    ap.add_argument("--out", required=True,
                    help="final state, written by rank 0; with {rank} in it, by every rank")
    ap.add_argument("--progress", default=os.environ.get("SR_PROGRESS_FILE"),
                    help="rank 0 appends 'STEP UNIX_TIME' here after each step (default: SR_PROGRESS_FILE, "
                         "which `slurm-resilience run` sets: its recovery ends at the first line)")
    args = ap.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)  # env:// via MASTER_ADDR/PORT
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    snapshot = os.path.join(args.ckpt, "snapshot.pt")
    start = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    if rank == 0:
        print(f"restart {os.environ.get('SR_RESTART', '0')}: world {world}, from step {start}", flush=True)

    params = list(model.parameters())
    for step in range(start, args.steps):
        first = (step * world + rank) * args.batch
        idx = torch.arange(first, first + args.batch) % len(x)  # global sample index
        opt.zero_grad()
        loss = F.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        time.sleep(args.step_time)
        if rank == 0 and args.progress:
            with open(args.progress, "a") as f:
                f.write(f"{step + 1} {time.time():.6f}\n")
        if args.stamps and rank == 0:
            with open(args.stamps, "a") as f:
                f.write(f"{os.environ.get('SR_RESTART', '0')} {step + 1} {time.time():.6f}\n")
        if rank == 0 and (step + 1) % SNAPSHOT_EVERY == 0:
            os.makedirs(args.ckpt, exist_ok=True)
            save_atomic({"step": step + 1, "model": model.state_dict(), "optimizer": opt.state_dict()},
                        snapshot)
            print(f"step {step + 1} loss {loss.item():.5f} (snapshot)", flush=True)
    final = {"step": args.steps, "model": model.state_dict(), "optimizer": opt.state_dict()}
    if "{rank}" in args.out:
        torchrun = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE")
        final["env"] = {k: os.environ.get(k) for k in torchrun}
        final["host"] = os.environ.get("SLURMD_NODENAME") or os.uname().nodename  # where it ran
        save_atomic(final, args.out.format(rank=rank))
    elif rank == 0:
        save_atomic(final, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
