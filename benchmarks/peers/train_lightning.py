"""benchmarks/peers/train.py written as a PyTorch Lightning program, resumed the way
Lightning's docs advise: ``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` and
``fit(ckpt_path="last")``. Under torchrun it names ``TorchElasticEnvironment``; under srun
Lightning's own ``SLURMEnvironment`` (its SIGUSR1 auto-requeue) is used. The same model,
data (sample index = (step x world + rank) x batch), step padding, step log, digest and
PID files as the plain script: the benchmark counts the lines that differ.
"""

import argparse
import hashlib
import os
import time

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.environments import TorchElasticEnvironment
from torch import nn


def make_data(n: int = 4096, d_in: int = 32, d_out: int = 4):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, d_out, generator=g)
    return x, y


class Steps(torch.utils.data.Dataset):
    def __init__(self, steps: int, world: int, batch: int):
        self.x, self.y = make_data()
        self.steps, self.world, self.batch = steps, world, batch

    def __len__(self):
        return self.steps * self.world

    def __getitem__(self, i):
        idx = torch.arange(i * self.batch, (i + 1) * self.batch) % len(self.x)
        return self.x[idx], self.y[idx]


class MLP(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        self.args, self.t0 = args, 0.0

    def training_step(self, batch, i):
        self.t0 = time.time()
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, i):
        time.sleep(max(0.0, self.t0 + self.args.step_time - time.time()))
        if self.global_rank == 0:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
            with open(self.args.steplog, "a") as f:
                f.write(f"{restart} {self.global_step} {self.t0:.6f} {time.time():.6f}\n")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


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
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="unused: Lightning sets its own")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--steplog", required=True)
    ap.add_argument("--digest", required=True)
    ap.add_argument("--pids", required=True)
    args = ap.parse_args()

    rank = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    os.makedirs(args.pids, exist_ok=True)
    with open(os.path.join(args.pids, f"rank-{rank}"), "w") as f:
        f.write(f"{os.getpid()} {os.environ.get('SLURMD_NODENAME', '')}")
    torch.set_num_threads(1)
    elastic = "TORCHELASTIC_RUN_ID" in os.environ
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    data = torch.utils.data.DataLoader(Steps(args.steps, world, args.batch), batch_size=None, shuffle=False)
    ckpt = ModelCheckpoint(dirpath=args.ckpt, every_n_train_steps=args.snapshot_every, save_top_k=0, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=world // per_node, strategy="ddp",
                         max_steps=args.steps, callbacks=[ckpt], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[TorchElasticEnvironment()] if elastic else None)
    model = MLP(args)
    trainer.fit(model, train_dataloaders=data, ckpt_path="last")
    if trainer.global_rank == 0:
        with open(args.digest, "w") as f:
            f.write(digest(model, trainer.optimizers[0]) + "\n")


if __name__ == "__main__":
    main()
