"""An mpi4py data-parallel program whose communicator is repaired in place (ULFM).

A linear model trained by SGD on a fixed synthetic data set. The state the toolkit
keeps a copy of is registered once: the weights, the bias and ``pos``, the global
index of the next sample. Each step a rank reads samples ``pos + rank*batch ...``;
the gradients are gathered and added in rank order (bit-identical whatever the
collective's algorithm and whichever node a rank is on), every rank applies the same
update, ``pos`` moves by ``size*batch``. After a scale-in the same positions are
split among fewer ranks.

Run it through ``slurm-resilience run --mpi`` (it picks in-place repair, launches
the bundled ``mpirun --with-ft ulfm`` over the workers then the spare nodes and sets
``SR_ULFM_SPARES``, ``SR_ULFM_EVENTS``, ``SR_PROGRESS_FILE``)::

    slurm-resilience run --mpi --nodes 4 --spares 1 -- \
        /opt/slurm-resilience/ulfm/bin/python mpi_ulfm_train.py --snapshot ckpt --out final.npz

or by hand inside an allocation (4 active ranks + 1 spare, one per node)::

    mpirun --with-ft ulfm -n 5 --map-by ppr:1:node python mpi_ulfm_train.py \
        --spares 1 --out final.npz

(``python -m slurm_resilience.mpi.launch --print`` shows the full line with its
transport options). ``--snapshot`` is the program's own snapshot, for the relaunch
that follows a node loss (docs/mpi-ulfm.md).
"""

import argparse
import os
import signal
import sys
import time

import numpy as np

from slurm_resilience.mpi import Session, UlfmUnavailableError


def make_data(n: int = 4096, d_in: int = 16, d_out: int = 3):
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((n, d_in))
    w = rng.standard_normal((d_in, d_out))
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((n, d_out))
    return x, y


def save_atomic(path: str, **arrays) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--spares", type=int, default=None,
                    help="the world's last ranks that park as spares (default: SR_ULFM_SPARES, set by the launcher)")
    ap.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (emulated compute)")
    ap.add_argument("--out", required=True, help="final state (.npz), written by rank 0")
    ap.add_argument("--init", help="start from this state (.npz with w, b, pos, step)")
    ap.add_argument("--dump-at", type=int, default=-1, help="rank 0 writes the state of this step to OUT.stepN.npz")
    ap.add_argument("--progress", default=os.environ.get("SR_PROGRESS_FILE"),
                    help="rank 0 appends 'STEP UNIX_TIME' here after each step (default: SR_PROGRESS_FILE)")
    ap.add_argument("--snapshot", help="directory of the program's own snapshot: rank 0 writes it every "
                    "--snapshot-every steps, every rank resumes from it at start (a relaunch after a node loss)")
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--events", help="directory of the per-process event files")
    ap.add_argument("--die", action="append", default=[], metavar="WID:STEP",
                    help="test: world rank WID SIGKILLs itself when it starts STEP (repeatable)")
    ap.add_argument("--die-in-repair", type=int, default=-1, metavar="WID",
                    help="test: world rank WID SIGKILLs itself in a repair, after Shrink and the allgather")
    args = ap.parse_args()
    try:
        die = {tuple(int(v) for v in d.split(":")) for d in args.die}
    except ValueError:
        sys.exit(f"mpi_ulfm_train: --die takes WID:STEP, not {args.die}")

    def observer(kind: str, rec: dict) -> None:
        if kind == "gathered" and rec["wid"] == args.die_in_repair:  # past Shrink, before Agree
            os.kill(os.getpid(), signal.SIGKILL)

    x, y = make_data()
    w = np.zeros((x.shape[1], y.shape[1]))
    b = np.zeros(y.shape[1])
    pos = np.zeros(1, dtype=np.int64)
    first_step = 0
    snapshot = os.path.join(args.snapshot, "snapshot.npz") if args.snapshot else None
    if snapshot and os.path.exists(snapshot):
        args.init = snapshot
    if args.init:
        with np.load(args.init) as s:
            w[...], b[...], pos[...] = s["w"], s["b"], s["pos"]
            first_step = int(s["step"])

    try:
        session = Session({"w": w, "b": b, "pos": pos}, spares=args.spares, events=args.events,
                          observer=observer)
    except UlfmUnavailableError as exc:
        sys.exit(f"mpi_ulfm_train: {exc}")
    session.step = first_step

    def train_step(comm, step: int) -> None:
        if (session.wid, step) in die:
            os.kill(os.getpid(), signal.SIGKILL)
        rank, size = comm.Get_rank(), comm.Get_size()
        first = int(pos[0]) + rank * args.batch
        idx = np.arange(first, first + args.batch) % len(x)  # global sample index
        err = x[idx] @ w + b - y[idx]
        local = np.concatenate([(x[idx].T @ err).ravel(), err.sum(axis=0)])
        every = np.empty((size, local.size))
        comm.Allgather(local, every)
        grad = np.zeros_like(local)
        for r in range(size):  # rank order: the same sum on every rank, every run
            grad += every[r]
        grad *= 2.0 / (size * args.batch)
        w[...] -= args.lr * grad[:w.size].reshape(w.shape)
        b[...] -= args.lr * grad[w.size:]
        pos[0] += size * args.batch
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0 and snapshot and (step + 1) % args.snapshot_every == 0:
            save_atomic(snapshot, w=w, b=b, pos=pos, step=np.int64(step + 1))
        if rank == 0 and step + 1 == args.dump_at:
            np.savez(f"{args.out}.step{step + 1}.npz", w=w, b=b, pos=pos, step=np.int64(step + 1))
        if rank == 0 and args.progress:
            with open(args.progress, "a") as f:
                f.write(f"{step + 1} {time.time():.6f} {size}\n")

    session.run(train_step, args.steps)
    if not session.is_spare and session.rank == 0:
        np.savez(args.out, w=w, b=b, pos=pos, step=np.int64(session.step))
        print(f"done: {session.step} steps, world {session.size}, repairs {session.repairs}", flush=True)
    session.close(0)


if __name__ == "__main__":
    main()
