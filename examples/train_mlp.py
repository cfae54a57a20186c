"""A small deterministic MLP trained data-parallel under slurm_resilience (CPU, gloo).

Ordinary PyTorch; the four marked lines are the library. Deterministic by
construction: data chosen by global sample index, SUM all-reduce, one thread.
"""

import argparse
import ctypes
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from slurm_resilience import ResumableSampler, Session  # (1)


def make_data(n: int = 4096, d_in: int = 32, d_out: int = 4):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--step-time", type=float, default=0.05, help="extra seconds after each step (emulated work "
                                                                   "outside it: logging, evaluation)")
    ap.add_argument("--compute-time", type=float, default=0.0, help="seconds of emulated forward/backward inside "
                                                                    "each step, before its all-reduce")
    ap.add_argument("--slow-node", default="", help="tests: emulate a slow device on this node")
    ap.add_argument("--slow-ms", type=float, default=0.0)
    ap.add_argument("--block-node", default="", help="tests: the first process on this node blocks forever")
    ap.add_argument("--gil-node", default="", help="tests: the first process on this node holds the GIL")
    ap.add_argument("--fault-at", type=int, default=8, help="tests: ... at this step")
    ap.add_argument("--gil-s", type=float, default=3.0, help="tests: ... for this long")
    ap.add_argument("--block-file", default="", help="tests: once this file holds this process's worker id, its "
                                                     "main thread blocks forever (the injector times the fault)")
    args = ap.parse_args()
    first = os.environ.get("SR_GENERATION") == "0"  # a restarted rank does not repeat the fault

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.5)
    sampler = ResumableSampler(num_samples=len(x), per_rank_batch=args.batch, seed=0)

    with Session() as session:  # (2) a warm standby waits here until it is adopted
        session.register(model=model, optimizer=opt, scheduler=sched)  # (3)
        # User extras are saved and restored with the state. Like the model they are
        # replicated: one rank's copy restores every rank, so keep only values that are
        # the same on every rank (here the sum of learning rates used so far).
        session.extras.setdefault("lr_sum", 0.0)
        for step in session.steps(args.steps):
            with step:
                idx = step.samples(sampler)
                opt.zero_grad()
                loss = F.mse_loss(model(x[idx]), y[idx])
                loss.backward()
                if args.compute_time:
                    time.sleep(args.compute_time)  # a bigger model's compute: where a real one spends it
                if args.slow_node and os.environ.get("SR_NODE") == args.slow_node:
                    time.sleep(args.slow_ms / 1000)  # a straggler: slower compute, same math
                if first and step.index == args.fault_at and os.environ.get("SR_NODE") in (args.block_node,
                                                                                            args.gil_node):
                    _inject(args)
                if first and args.block_file and _named(args.block_file):
                    _block_forever()
                session.all_reduce_gradients(model)  # (4) collectives first, update last
                opt.step()
                sched.step()
                session.extras["lr_sum"] += sched.get_last_lr()[0]
            time.sleep(args.step_time)
            if session.rank == 0 and step.index % 10 == 0:
                print(f"step {step.index} loss {loss.item():.5f}", flush=True)


def _named(path: str) -> bool:
    """The injector wrote this process's worker id into ``path`` (written whole, then renamed)."""
    try:
        with open(path) as f:
            return f.read().strip() == os.environ.get("SR_WORKER_ID")
    except FileNotFoundError:
        return False


def _block_forever() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # a deadlock: blocks forever


def _inject(args) -> None:
    """Tests of the progress watchdog: a main thread that never comes back (its heartbeat
    thread and process live on), or one that holds the GIL (no other thread runs)."""
    if os.environ.get("SR_NODE") == args.block_node:
        _block_forever()
    else:
        # ctypes.PyDLL calls keep the GIL (CDLL would release it): for these seconds
        # no thread of this interpreter runs, the heartbeat thread included.
        ctypes.PyDLL(None).usleep(int(args.gil_s * 1e6))


if __name__ == "__main__":
    main()
