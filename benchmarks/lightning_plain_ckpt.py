"""The plain twin (examples/lightning_train_plain.py) as a fast-recovering Lightning user
sets it up without this toolkit, for benchmarks/lightning_mttr.py.

Its LightningModule and DataModule unchanged; the Trainer gets what Lightning's docs
advise for resuming: ``ModelCheckpoint(every_n_train_steps=1, save_last=True)`` (every
optimizer step, here on the lab's shared file system) and ``fit(ckpt_path="last")``.
Under torchrun it names ``TorchElasticEnvironment`` (Lightning would pick it first anyway);
under srun Lightning's own ``SLURMEnvironment`` (with its SIGUSR1 auto-requeue) is used.

For the benchmark's timing only: rank 0 appends ``ATTEMPT STEP UNIX_TIME`` to
``--progress`` after every step (ATTEMPT: Slurm's restart count, or under torchrun the count of
rank-0 processes before this one), and every
rank writes its PID to ``--pids/rank-R`` (the fault is injected by PID).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.environments import TorchElasticEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lightning_train_plain import MLP, Regression  # noqa: E402


def attempt(progress: Path) -> int:
    """Rank 0's attempt: Slurm's restart count under srun; under torchrun one more than the
    progress file's last attempt (``TORCHELASTIC_RESTART_COUNT`` counts only the restarts of
    the local agent: on the node whose workers did not fail it stays 0)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    lines = progress.read_text().split() if progress.exists() else []
    return int(lines[-3]) + 1 if len(lines) >= 3 else 0


class Progress(pl.Callback):
    """Rank 0: ``ATTEMPT STEP UNIX_TIME`` after every completed step (as the Resilience
    callback's ``SR_PROGRESS_FILE`` line, so every contender is timed the same way)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.attempt: int | None = None

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_rank == 0:
            if self.attempt is None:
                self.attempt = attempt(Path(self.path))
            with open(self.path, "a") as f:
                f.write(f"{self.attempt} {trainer.global_step} {time.time():.6f}\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--ckpt", required=True, help="ModelCheckpoint's directory (last.ckpt)")
    ap.add_argument("--progress", required=True)
    ap.add_argument("--pids", required=True)
    args = ap.parse_args()

    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    Path(args.pids).mkdir(parents=True, exist_ok=True)
    (Path(args.pids) / f"rank-{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    ckpt = ModelCheckpoint(dirpath=args.ckpt, every_n_train_steps=1, save_top_k=0, save_last=True,
                           enable_version_counter=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=per_node, num_nodes=world // per_node, strategy="ddp", max_epochs=args.epochs,
        callbacks=[ckpt, Progress(args.progress)], plugins=[TorchElasticEnvironment()] if elastic else None,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.ckpt,
    )
    trainer.fit(MLP(args.step_time), datamodule=Regression(args.batch), ckpt_path="last")


if __name__ == "__main__":
    main()
