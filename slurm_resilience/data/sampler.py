"""Exact data position: which global samples a rank reads at a given step.

The data order is a pure function of (seed, epoch) and the position is one integer —
the number of global samples consumed by completed steps (``Session.position``, saved
and restored with the state) — so rolling back is setting that integer. A replaced
rank computes exactly the samples its predecessor would have, and no sample is
skipped or seen twice across a recovery, a scale-in included (the world size may
change between two steps; the position does not jump).

    global batch starting at position p:   order[p : p + B]         B = world_size * per_rank
    rank r's share:                        order[p + r*b : p + (r+1)*b]      b = per_rank
    order[q] = perm_{seed, q // n}(q % n)  (``data/permutation.py``: nothing of size n is built)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import DataError
from .permutation import MAX_N, permute


__all__ = ["MAX_POSITION", "ResumableSampler"]


MAX_POSITION = (1 << 63) - 1  # positions travel as int64


@dataclasses.dataclass(frozen=True)
class ResumableSampler:
    """Deterministic, position-addressable sample order for data parallel training.

    num_samples: dataset size. per_rank_batch: samples per rank per step.
    seed: shuffling seed (same on every rank). shuffle: permute within each epoch.
    Memory is O(per_rank_batch) for any num_samples. Raises ``DataError`` (a
    ``ValueError``) for a size or batch below 1.
    """

    num_samples: int
    per_rank_batch: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("num_samples", "per_rank_batch", "seed"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise DataError(f"ResumableSampler {name}={value!r} must be an integer")
        if self.num_samples < 1 or self.per_rank_batch < 1:
            raise DataError(f"ResumableSampler num_samples={self.num_samples} and per_rank_batch="
                            f"{self.per_rank_batch} must be >= 1")
        if self.num_samples > MAX_N:
            raise DataError(f"ResumableSampler num_samples={self.num_samples} is above 2**62")

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
        Raises ``DataError`` for a negative position or rank.
        """
        if rank < 0:
            raise DataError(f"rank={rank} must be >= 0")
        start = position + rank * self.per_rank_batch
        return self.order(start, self.per_rank_batch).tolist()

    def batch_size(self, world_size: int) -> int:
        """Global samples consumed by one step."""
        return world_size * self.per_rank_batch

    def order(self, start: int, count: int) -> np.ndarray:
        """Dataset indices at global positions [start, start + count) (int64 array).

        Epochs roll over by position: position q is offset q % n of epoch q // n.
        Raises ``DataError`` for a negative start or one past 2**63 - 1.
        """
        if start < 0:
            raise DataError(f"data position={start} must be >= 0: it counts the global samples consumed")
        if start + count > MAX_POSITION:
            raise DataError(f"data position={start} + {count} is past 2**63 - 1")
        n = self.num_samples
        epochs, offsets = np.divmod(np.arange(start, start + count, dtype=np.int64), n)
        if not self.shuffle:
            return offsets
        out = np.empty_like(offsets)
        for epoch in np.unique(epochs).tolist():  # a share spans at most a few epochs
            here = epochs == epoch
            out[here] = permute(offsets[here], n, self.seed, epoch)
        return out

    def _at(self, position: int) -> int:
        return int(self.order(position, 1)[0])
