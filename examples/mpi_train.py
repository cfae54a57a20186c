"""An ordinary mpi4py data-parallel program (numpy only): no slurm_resilience import.

A linear model trained by SGD; each rank computes the gradient of its slice of the
global batch, one Allreduce(SUM) adds them, every rank applies the same update.
Rank 0 saves a snapshot every 10 steps (tmp + os.replace) and every rank resumes
from it at start, so a relaunched run ends with the same bits as a fault-free one
(same world size, same data by global sample index, same reduction). After each
step rank 0 appends ``STEP UNIX_TIME`` to ``SR_PROGRESS_FILE`` when that is set
(``slurm-resilience run`` times a recovery to the first one: docs/restart.md).

Run with ``srun --mpi=pmix`` (what ``slurm-resilience run --mpi`` does) or mpirun.
"""

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

SNAPSHOT_EVERY = 10


def make_data(n: int = 4096, d_in: int = 16, d_out: int = 3):
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((n, d_in))
    w = rng.standard_normal((d_in, d_out))
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((n, d_out))
    return x, y


def save_atomic(path: str, **arrays) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--step-time", type=float, default=0.1, help="extra seconds per step (emulated compute)")
    ap.add_argument("--ckpt", required=True, help="directory of the snapshot (shared by all ranks)")
    ap.add_argument("--out", required=True, help="final weights (.npy), written by rank 0")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    x, y = make_data()
    w = np.zeros((x.shape[1], y.shape[1]))
    b = np.zeros(y.shape[1])
    snapshot = os.path.join(args.ckpt, "snapshot.npz")
    start = 0
    if os.path.exists(snapshot):
        with np.load(snapshot) as s:
            w, b, start = s["w"].copy(), s["b"].copy(), int(s["step"])
    if rank == 0:
        print(f"restart {os.environ.get('SR_RESTART', '0')}: world {world}, from step {start}", flush=True)

    total = world * args.batch
    for step in range(start, args.steps):
        first = (step * world + rank) * args.batch
        idx = np.arange(first, first + args.batch) % len(x)  # global sample index
        err = x[idx] @ w + b - y[idx]
        local = np.concatenate([(x[idx].T @ err).ravel(), err.sum(axis=0)]) * (2.0 / total)
        grad = np.empty_like(local)
        comm.Allreduce(local, grad, op=MPI.SUM)
        w -= args.lr * grad[:w.size].reshape(w.shape)
        b -= args.lr * grad[w.size:]
        time.sleep(args.step_time)
        if rank == 0 and os.environ.get("SR_PROGRESS_FILE"):
            with open(os.environ["SR_PROGRESS_FILE"], "a") as f:
                f.write(f"{step + 1} {time.time():.6f}\n")
        if rank == 0 and (step + 1) % SNAPSHOT_EVERY == 0:
            os.makedirs(args.ckpt, exist_ok=True)
            save_atomic(snapshot, w=w, b=b, step=np.int64(step + 1))
            print(f"step {step + 1} loss {float((err ** 2).mean()):.5f} (snapshot)", flush=True)
    if rank == 0:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, np.concatenate([w.ravel(), b]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, args.out)
    comm.Barrier()


if __name__ == "__main__":
    main()
