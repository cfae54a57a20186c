"""An ordinary FSDP2 training script under slurm_resilience (examples/train_fsdp_plain.py
is the same script before the change: torchrun, epoch checkpoints, auto-resume).

A small pre-norm transformer language model (token embedding, learned positions,
attention + MLP blocks with dropout, untied head) with ``fully_shard`` on every block
and on the root, AdamW, a warmup + cosine LR schedule, DataLoader workers over a
synthetic token dataset and rank-0 logging. The toolkit keeps the sharded model and
optimizer in its checkpoints and restores (and reshards) them after a fault, at the
exact data position: no epoch checkpoints, no resume code. Runs supervised
(``slurm-resilience submit -- python examples/train_fsdp.py``), under plain
``torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py`` or as one process.
"""

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

from slurm_resilience import ResumableLoader, ResumableSampler, Session


class Tokens(Dataset):
    """Map-style: token sequences from a fixed random bigram chain (learnable, not trivial)."""

    def __init__(self, n: int = 512, seq: int = 32, vocab: int = 64, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        nxt = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)
        seqs = torch.empty(n, seq + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(seq):
            seqs[:, t + 1] = torch.multinomial(nxt[seqs[:, t]], 1, generator=g).squeeze(1)
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i, :-1], self.seqs[i, 1:]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def warmup_cosine(warmup: int, total: int):
    """LambdaLR factor: linear warmup, then cosine decay to 0 at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (emulated compute)")
    ap.add_argument("--out", default=os.environ.get("SR_JOB_DIR", "."), help="where each rank's final state goes")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    data = Tokens()

    def build(mesh):
        """The model sharded on ``mesh``, its optimizer and LR schedule: built again on
        each generation's mesh, the state (restored, resharded) is loaded into it."""
        model = Transformer(dim=args.dim, layers=args.layers)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
        return model, opt, sched

    with Session() as session:  # a warm standby waits here until it is adopted
        fsdp = session.fsdp(build)  # registered; rebuilt on every generation's mesh
        sampler = ResumableSampler(num_samples=len(data), per_rank_batch=args.batch, seed=0)
        with ResumableLoader(data, sampler, num_workers=2) as loader:
            for step in session.steps(args.steps):
                with step:  # a fault (FSDP's all-gathers and reduce-scatters included) aborts the step
                    model, opt, sched = fsdp.model, fsdp.optimizer, fsdp.scheduler
                    x, y = step.batch(loader)
                    opt.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    loss.backward()
                    opt.step()  # collectives first (FSDP's in backward), the update last
                    sched.step()
                    if session.is_logger and not step.replay and step.index % 10 == 0:
                        print(f"step {step.index} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
                if args.step_time:
                    time.sleep(args.step_time)
        model_sd, _ = get_state_dict(fsdp.model, fsdp.optimizer)
        final = {"step": session.step, "model": {k: v.to_local() for k, v in model_sd.items()},
                 "scheduler": fsdp.scheduler.state_dict()}
        os.makedirs(args.out, exist_ok=True)
        torch.save(final, os.path.join(args.out, f"final-rank{session.rank}.pt"))


if __name__ == "__main__":
    main()
