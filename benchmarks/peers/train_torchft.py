"""benchmarks/peers/train.py changed the way torchft's docs and its train_ddp example ask:
one torchrun per replica group (REPLICA_GROUP_ID), a Manager talking to the lighthouse
(TORCHFT_LIGHTHOUSE), a fault-tolerant gloo process group for the all-reduce across
groups, the optimizer wrapped so a step commits only when the quorum agrees, the state
served to a recovering group by a live one (no snapshot to load). The logging lines are
the plain script's: group 0's rank 0 logs every committed step.
"""

import argparse
import datetime
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchft import Manager, ProcessGroupGloo
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
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="gloo collective timeout (s)")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steplog", required=True)
    ap.add_argument("--digest", required=True)
    ap.add_argument("--pids", required=True)
    args = ap.parse_args()

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    rank, world = group * int(os.environ["WORLD_SIZE"]) + int(os.environ["RANK"]), groups * int(os.environ["WORLD_SIZE"])
    os.makedirs(args.pids, exist_ok=True)
    with open(os.path.join(args.pids, f"rank-{rank}"), "w") as f:
        f.write(f"{os.getpid()} {os.environ.get('SLURMD_NODENAME', '')}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, timeout=timeout,
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
                      state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                      replica_id=f"group{group}")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SR_RESTART") or "0"

    params = list(model.parameters())
    while manager.current_step() < args.steps:
        step, t0 = manager.current_step(), time.time()
        first = (step * world + rank) * args.batch
        idx = torch.arange(first, first + args.batch) % len(x)
        manager.start_quorum()
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        time.sleep(max(0.0, t0 + args.step_time - time.time()))
        if not manager.should_commit():
            continue
        opt.step()
        if rank == 0:
            with open(args.steplog, "a") as f:
                f.write(f"{restart} {step + 1} {t0:.6f} {time.time():.6f}\n")
    if rank == 0:
        with open(args.digest, "w") as f:
            f.write(digest(model, opt) + "\n")
    manager.shutdown()


if __name__ == "__main__":
    main()
