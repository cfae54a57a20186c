"""One rank of a 2-rank Lightning job for tests/local/test_lightning_rng.py (launched by it).

Each rank is its own "node" (``SLURMD_NODENAME`` n0/n1, snapshots under
``SR_LIGHTNING_DIR``). The model has dropout; every rank seeds its generators
differently in its ``setup`` hook (torch, Python ``random``, numpy), so a rank that
continued with another rank's stream would train differently. The dataset reports the
seed Lightning's DataLoader gave its worker (minus the worker id: the iterator's base
seed). ``--die-at N``: rank 1 SIGKILLs itself after its N-th batch (``--accumulate``
batches per optimizer step: a mid-window kill). At the end every rank writes its
weights, the batches' base seeds and one draw of each generator to ``--out/rank-R.pt``.
"""

import argparse
import faulthandler
import os
import random
import signal
import sys
import time

import numpy
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from slurm_resilience.integrations.lightning import Resilience


class Seeded(Dataset):
    """64 fixed samples; each item also carries its worker's base seed."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(64, 8, generator=g)
        self.y = torch.randn(64, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return self.x[i], self.y[i], torch.tensor(info.seed - info.id)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 2))
        self.seeds: list[tuple[int, int]] = []

    def setup(self, stage: str) -> None:
        """Per-rank streams (after Lightning's ``reset_seed`` in its process-group setup)."""
        rank = self.trainer.global_rank
        torch.manual_seed(100 + rank)
        random.seed(200 + rank)
        numpy.random.seed(300 + rank)

    def training_step(self, batch, batch_idx):
        x, y, seed = batch
        self.seeds.append((self.trainer.current_epoch, batch_idx, int(seed[0])))
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class DieAt(pl.Callback):
    def __init__(self, batches: int) -> None:
        self.batches, self.seen = batches, 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seen += 1
        if trainer.global_rank == 1 and self.seen == self.batches:
            time.sleep(0.2)  # rank 0 is in the next batch's collective by now, or soon
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--die-at", type=int, default=0)
    args = ap.parse_args()

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if a rank hangs
    torch.set_num_threads(1)
    rank = int(os.environ["NODE_RANK"])
    pl.seed_everything(0, verbose=False)
    callbacks = [Resilience()] + ([DieAt(args.die_at)] if args.die_at else [])
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_epochs=2,
                         accumulate_grad_batches=args.accumulate, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    loader = DataLoader(Seeded(), batch_size=4, shuffle=True, num_workers=2)
    trainer.fit(model, train_dataloaders=loader)
    draws = (torch.rand(1).item(), random.random(), float(numpy.random.rand()))
    torch.save({"weights": model.state_dict(), "seeds": model.seeds, "draws": draws,
                "steps": trainer.global_step}, os.path.join(args.out, f"rank-{rank}.pt"))
    # The result is on disk: end here. One CI run (2026-11-28) saw this job's last launch
    # outlive its 180 s after both ranks had trained to the end (rank 0 logged fit's end),
    # somewhere in the interpreter's teardown (DataLoader workers, the gloo group); the
    # test is about what was saved, not about that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
