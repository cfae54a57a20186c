"""A tiny FSDP2 (fully_shard) job for tests/local/test_fsdp.py (CPU, gloo).

Rows of 3 ranks do not divide the layer sizes evenly (7 rows: 3, 3, 1; 2 rows: 1, 1, 0),
so trailing ranks hold short and empty shards. AdamW + a LambdaLR schedule + dropout
(the RNG must be restored too).

``--die-in-flush STEP:RANK``: that rank SIGKILLs itself while writing its L1 shard of
STEP (half the file written), once per job (a marker file in the job directory).
``--dump-first PATH``: before this process's first step, rank 0 writes the full
(gathered) model and optimizer state, the scheduler's and the step to PATH.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from slurm_resilience import ResumableSampler, Session
from slurm_resilience.checkpoint import persist


def make_data(n: int = 512):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 6, generator=g)
    return x, torch.tanh(x @ torch.randn(6, 2, generator=g))


def build(mesh):
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Dropout(0.1), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 2))
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def die_in_flush(spec: str) -> None:
    step, rank = (int(v) for v in spec.split(":"))
    marker = Path(os.environ["SR_JOB_DIR"]) / "died-in-flush"
    real = persist.write_shard

    def write_shard(path, state, **kw):
        if int(kw.get("attrs", {}).get("step", -1)) == step and kw["attrs"].get("rank") == rank \
                and not marker.exists():
            marker.write_text(str(os.getpid()))
            info = real(path, state, **kw)
            with open(path, "r+b") as f:  # a torn shard: half of it on disk
                f.truncate(info.nbytes // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, state, **kw)

    persist.write_shard = write_shard


def dump_full(fsdp, session, path: str) -> None:
    """Collective: the state the first step starts from, gathered whole, by rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(fsdp.model, fsdp.optimizer, options=StateDictOptions(full_state_dict=True))
    if session.rank == 0:
        sched = {k: v for k, v in fsdp.scheduler.state_dict().items() if k != "lr_lambdas"}
        torch.save({"model": msd, "optimizer": osd, "scheduler": sched, "step": session.step}, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--die-in-flush", default="")
    ap.add_argument("--dump-first", default="")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    if args.die_in_flush:
        die_in_flush(args.die_in_flush)
    x, y = make_data()
    sampler = ResumableSampler(num_samples=len(x), per_rank_batch=args.batch, seed=0)
    with Session() as session:
        fsdp = session.fsdp(build)  # registers model, optimizer (sharded) and scheduler
        for step in session.steps(args.steps):
            with step:
                if args.dump_first:
                    dump_full(fsdp, session, args.dump_first)
                    args.dump_first = ""
                idx = step.samples(sampler)
                loss = F.mse_loss(fsdp(x[idx]), y[idx])
                loss.backward()
                fsdp.optimizer.step()
                fsdp.optimizer.zero_grad(set_to_none=True)
                fsdp.scheduler.step()
            if args.step_time:
                time.sleep(args.step_time)


if __name__ == "__main__":
    main()
