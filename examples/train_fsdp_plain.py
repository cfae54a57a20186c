"""An ordinary elastic FSDP2 training script, before slurm_resilience: the kind this
project grew from (examples/train_fsdp.py is the same script under the toolkit).

A small pre-norm transformer language model (token embedding, learned positions,
attention + MLP blocks, untied head) with ``fully_shard`` on every block and on the
root, AdamW, a warmup + cosine LR schedule, a DistributedSampler/DataLoader over a
synthetic token dataset, an end-of-epoch checkpoint with torch.distributed.checkpoint
and auto-resume from the newest one (a restarted job loses the epoch it was in).
Runs under ``torchrun --standalone --nproc-per-node 2 examples/train_fsdp_plain.py``.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler


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


def newest_epoch(ckpt_dir: str) -> int | None:
    done = [int(n.split("-")[1]) for n in os.listdir(ckpt_dir) if n.startswith("epoch-")] if os.path.isdir(ckpt_dir) else []
    return max(done) if done else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ckpt", default="ckpt-fsdp", help="epoch checkpoints (DCP); the newest is resumed")
    ap.add_argument("--out", default=".", help="where each rank's final state goes")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    data = Tokens()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = Transformer(dim=args.dim, layers=args.layers)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=2, drop_last=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, total))

    start = 0
    last = newest_epoch(args.ckpt)
    if last is not None:  # auto-resume: the epoch in progress when the job died is redone
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt, f"epoch-{last}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = last + 1
        if rank == 0:
            print(f"resumed after epoch {last}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 10 == 0:
                print(f"epoch {epoch} step {i} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt, f"epoch-{epoch}"))
    model_sd, opt_sd = get_state_dict(model, opt)
    final = {"model": {k: v.to_local() for k, v in model_sd.items()}, "scheduler": sched.state_dict()}
    os.makedirs(args.out, exist_ok=True)
    torch.save(final, os.path.join(args.out, f"final-rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
