"""Facts behind docs/data-loading.md: what torchdata's StatefulDataLoader state can and
cannot do for this toolkit (resharding on scale-in, peer restore, worker-count changes,
augmentation RNG). Needs ``pip install torchdata`` (not a dependency of the toolkit);
prints one JSON object. Run: python scripts/torchdata_state_check.py"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch.utils.data import Dataset, DistributedSampler

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:
    sys.exit("torchdata is not installed: pip install torchdata (into a throwaway venv)")

warnings.filterwarnings("ignore")
N, B = 48, 2


class Index(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Noisy(Index):
    def __getitem__(self, i):
        return float(i) + torch.rand(()).item()


def loader(rank, world, workers, dataset=None):
    ds = dataset or Index()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return StatefulDataLoader(ds, batch_size=B, sampler=sampler, num_workers=workers)


def take(dl, k, state=None):
    if state is not None:
        dl.load_state_dict(state)
    it = iter(dl)
    return [v for _ in range(k) for v in next(it).tolist()]


def after(rank, world, workers, steps, dataset=None):
    """(samples seen in ``steps`` steps, the state then) for one rank."""
    dl = loader(rank, world, workers, dataset)
    it = iter(dl)
    seen = [v for _ in range(steps) for v in next(it).tolist()]
    return seen, dl.state_dict()


def main():
    out = {}
    seen, state = after(1, 4, 2, 3)
    out["state_keys"] = sorted(state["_snapshot"]["_main_snapshot"])
    out["per_worker_snapshots"] = sorted(state["_snapshot"]["_worker_snapshots"])
    try:  # the same rank, restored with another worker count
        take(loader(1, 4, 3), 1, state)
        out["restore_2_workers_into_3"] = "ok"
    except Exception as e:  # noqa: BLE001 - the fact recorded is which error
        out["restore_2_workers_into_3"] = f"{type(e).__name__}: {str(e)[:120]}".rstrip(": ")
    # scale-in 4 -> 3 after 3 steps: each world-3 rank restores a world-4 rank's state
    first = [after(r, 4, 0, 3) for r in range(4)]
    consumed = [v for s, _ in first for v in s]
    rest = [take(loader(r, 3, 0), N // (3 * B) - 3, first[r][1]) for r in range(3)]
    later = [v for s in rest for v in s]
    out["scale_in_4_to_3"] = {
        "samples_before": len(consumed), "samples_after": len(later),
        "repeated_in_epoch": len(set(consumed) & set(later)),
        "never_seen_in_epoch": N - len(set(consumed) | set(later)),
    }
    # peer restore: rank 0's state loaded by rank 1's loader (same world)
    own = take(loader(1, 4, 0), 2, first[1][1])
    peer = take(loader(1, 4, 0), 2, first[0][1])
    out["rank0_state_restores_rank1"] = own == peer
    # augmentation RNG inside __getitem__: continuous vs restored, and 0 vs 2 workers
    noisy_cont = take(loader(0, 1, 2, Noisy()), 6)
    _, st = after(0, 1, 2, 3, Noisy())
    noisy_resumed = take(loader(0, 1, 2, Noisy()), 3, st)
    out["augmentation_equal_after_restore"] = noisy_resumed == noisy_cont[3 * B:]
    out["augmentation_equal_0_vs_2_workers"] = take(loader(0, 1, 0, Noisy()), 6) == noisy_cont
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
