"""What the integrations' per-step preemption check costs under ``run``.

``integrations.snapshots.preempt_requested`` runs after every step of a Lightning or
Accelerate job launched by ``slurm-resilience run``: rank 0 ``stat``s
``JOBDIR/preempt.request`` and broadcasts one int over the default group. This times it
(gloo on 127.0.0.1, N local processes), against a bare 1-element broadcast.

    python benchmarks/preempt_check_cost.py --ranks 4 --iters 2000

Prints one JSON line: median and p99 microseconds per call for both.
"""

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurm_resilience.integrations.snapshots import preempt_requested


def _times(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def _worker(rank: int, world: int, port: int, iters: int, job_dir: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    flag = torch.zeros(1, dtype=torch.long)
    for _ in range(50):  # warm-up
        dist.broadcast(flag, src=0)
    dist.barrier()
    bare = _times(lambda: dist.broadcast(flag, src=0), iters)
    dist.barrier()
    check = _times(lambda: preempt_requested(job_dir, rank=rank, world_size=world), iters)
    if rank == 0:
        def stats(xs):
            xs = sorted(xs)
            return {"median_us": round(statistics.median(xs), 1), "p99_us": round(xs[int(len(xs) * 0.99)], 1)}
        queue.put({"ranks": world, "iters": iters, "broadcast_1_int": stats(bare), "preempt_check": stats(check)})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as job_dir:
        mp.start_processes(_worker, args=(args.ranks, port, args.iters, job_dir, queue), nprocs=args.ranks,
                           start_method="spawn")
        result = queue.get(timeout=10)
    result["cpus"] = os.cpu_count()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
