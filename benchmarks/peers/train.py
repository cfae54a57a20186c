"""The plain training script of benchmarks/peers.py: what a user writes without any
fault-tolerance library (torchrun-style environment, gloo, its own snapshot every
``--snapshot-every`` steps, resumed when relaunched).

Every system trains this, or a copy changed the way its docs ask (train_torchft.py); the
benchmark counts the changed lines. Deterministic: seeded data chosen by global sample
index, one flat SUM all-reduce of the gradients, one thread. Rank 0 appends
``RESTART STEP T_START T_END`` (wall times of the step's start and end) to ``--steplog``
after every completed step, and writes the sha256 of its final parameters and optimizer
state to ``--digest``. Every rank writes its PID and node to ``--pids/rank-R`` (the fault
injector reads them).
"""

import argparse
import datetime
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def make_data(n: int = 4096, d_in: int = 32, d_out: int = 4):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return x, y


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for t in [*model.state_dict().values(), *(s for st in opt.state_dict()["state"].values() for s in st.values())]:
        h.update(t.detach().contiguous().numpy().tobytes() if torch.is_tensor(t) else repr(t).encode())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-time", type=float, default=0.2, help="every step is padded to this long (s)")
    ap.add_argument("--snapshot-every", type=int, default=5)
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="timeout of a training collective (s)")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steplog", required=True)
    ap.add_argument("--digest", required=True)
    ap.add_argument("--pids", required=True)
    args = ap.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(args.pids, exist_ok=True)
    with open(os.path.join(args.pids, f"rank-{rank}"), "w") as f:
        f.write(f"{os.getpid()} {os.environ.get('SLURMD_NODENAME', '')}")
    dist.init_process_group("gloo", rank=rank, world_size=world)  # ranks may start seconds apart
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SR_RESTART") or "0"

    snapshot = os.path.join(args.ckpt, "snapshot.pt")
    start = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]

    params = list(model.parameters())
    for step in range(start, args.steps):
        t0 = time.time()
        first = (step * world + rank) * args.batch
        idx = torch.arange(first, first + args.batch) % len(x)
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        time.sleep(max(0.0, t0 + args.step_time - time.time()))
        if rank == 0:
            with open(args.steplog, "a") as f:
                f.write(f"{restart} {step + 1} {t0:.6f} {time.time():.6f}\n")
            if (step + 1) % args.snapshot_every == 0:
                os.makedirs(args.ckpt, exist_ok=True)
                tmp = f"{snapshot}.tmp"
                torch.save({"step": step + 1, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
                os.replace(tmp, snapshot)
    if rank == 0:
        with open(args.digest, "w") as f:
            f.write(digest(model, opt) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
