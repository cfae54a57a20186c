"""Exact data position: which global samples a rank reads at a given step.

The data order is a pure function of (seed, epoch) and the position is one integer —
the number of global samples consumed by completed steps (``Session.position``, saved
and restored with the state) — so rolling back is setting that integer. A replaced
rank computes exactly the samples its predecessor would have, and no sample is
skipped or seen twice across a recovery, a scale-in included (the world size may
change between two steps; the position does not jump).

    global batch starting at position p:   perm[p : p + B]         B = world_size * per_rank
    rank r's share:                        perm[p + r*b : p + (r+1)*b]      b = per_rank
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumableSampler:
    """Deterministic, position-addressable sample order for data parallel training.

    num_samples: dataset size. per_rank_batch: samples per rank per step.
    seed: shuffling seed (same on every rank). shuffle: permute within each epoch.
    """

    num_samples: int
    per_rank_batch: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.per_rank_batch < 1:
            raise ValueError("num_samples and per_rank_batch must be >= 1")

    def global_position(self, step: int, world_size: int) -> int:
        """Index of the first global sample of ``step`` (the rollback point)."""
        return step * world_size * self.per_rank_batch

    def indices(self, step: int, rank: int, world_size: int) -> list[int]:
        """Sample indices rank ``rank`` reads at ``step`` of a fixed world size."""
        return self.indices_at(self.global_position(step, world_size), rank)

    def indices_at(self, position: int, rank: int) -> list[int]:
        """Indices rank ``rank`` reads in the global batch starting at sample ``position``.

        The position, not the step, is the rollback point: after a change of world
        size the next global batch starts exactly where the last one ended.
        """
        start = position + rank * self.per_rank_batch
        return [self._at(p) for p in range(start, start + self.per_rank_batch)]

    def batch_size(self, world_size: int) -> int:
        """Global samples consumed by one step."""
        return world_size * self.per_rank_batch

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        return self._permutation(epoch)[offset]

    def _permutation(self, epoch: int) -> list[int]:
        cache = self.__dict__.setdefault("_perm_cache", {})
        if epoch not in cache:
            order = list(range(self.num_samples))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            cache.clear()  # keep one epoch: memory stays O(num_samples)
            cache[epoch] = order
        return cache[epoch]
