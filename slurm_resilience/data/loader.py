"""A DataLoader whose whole resumable state is (seed, position).

``ResumableLoader`` wraps a real ``torch.utils.data.DataLoader`` (workers, prefetch,
pinned memory, collate) over a map-style dataset. Its batch sampler yields this
rank's share of every global batch from a start position onward (the order of
``ResumableSampler``), so the batch of a step is a function of (seed, position,
rank, world size) and nothing else:

* the next step's batch comes from the live iterator (workers keep prefetching);
* any other request — a rollback, a new rank or world size after a recovery or a
  scale-in, a restart after a requeue — drops the iterator and starts one at that
  position. Nothing per rank or per worker needs checkpointing: the position is the
  session's own (``TrainingState.position``), replicated on every rank.

Per-sample randomness is part of that state too: each key the batch sampler yields
carries the sample's global position, and the dataset wrapper seeds torch's CPU
generator, ``random`` and ``numpy.random`` from (seed, position) just before
``dataset[index]``. An augmentation drawing from those RNGs gives the same bits for
any ``num_workers``, after any rollback, restart or scale-in. The user's dataset
sees the original index; CUDA RNG inside ``__getitem__`` is not seeded.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..errors import DataError
from .permutation import _mix_int
from .sampler import ResumableSampler


__all__ = ["sample_seed", "ResumableLoader"]


_M64 = (1 << 64) - 1
_SALT = 0x5EED5A3D1E5A17  # separates sample seeds from the permutation's round keys


def sample_seed(seed: int, position: int) -> int:
    """The 64-bit RNG seed of the sample at global ``position`` (pure)."""
    return _mix_int(_mix_int((seed ^ _SALT) & _M64) ^ (position & _M64))


class _PositionBatches:
    """Batch sampler: rank ``rank``'s share of each global batch from ``start`` on,
    as keys ``(global position, dataset index)``. Endless: epochs roll over."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler
        self.start, self.rank, self.world = 0, 0, 1

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        b = self.sampler.per_rank_batch
        step_size = self.sampler.batch_size(self.world)
        position = self.start
        while True:
            first = position + self.rank * b
            indices = self.sampler.order(first, b).tolist()
            yield [(first + j, i) for j, i in enumerate(indices)]
            position += step_size


class _SeededItems(Dataset):
    """``dataset[index]`` with the RNGs seeded from (seed, global position) first.

    The DataLoader's fetcher calls ``__getitems__`` with a whole batch of keys. In the
    main process (``num_workers=0``) the global RNG states are saved before the batch
    and restored after it, so the training loop's own randomness is untouched."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        if get_worker_info() is not None:  # a worker process: its RNGs are ours
            return self._items(keys)
        saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            return self._items(keys)
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def _items(self, keys: list[tuple[int, int]]) -> list[Any]:
        out = []
        for position, index in keys:
            _seed_all(sample_seed(self.seed, position))
            out.append(self.dataset[index])
        return out


def _seed_all(s: int) -> None:
    torch.default_generator.manual_seed(s)  # CPU only: CUDA generators are the loop's
    random.seed(s)
    np.random.seed([s & 0xFFFFFFFF, s >> 32])


class ResumableLoader:
    """Batches of a map-style dataset at exact global positions, with DataLoader workers.

    ``batch_at(position, rank, world_size)`` (or ``step.batch(loader)``) returns the
    collated batch rank ``rank`` trains on at the step starting at ``position``.
    Keyword arguments are the DataLoader's. Use ``with`` or ``close()``: the workers
    stop there. Raises ``DataError`` for an iterable-style dataset, a dataset shorter
    than ``sampler.num_samples``, a bad ``num_workers`` / ``prefetch_factor``.
    """

    def __init__(self, dataset: Any, sampler: ResumableSampler, *, num_workers: int = 0,
                 collate_fn: Callable | None = None, pin_memory: bool = False,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 worker_init_fn: Callable | None = None, multiprocessing_context: Any = None) -> None:
        _check(dataset, sampler, num_workers, prefetch_factor, persistent_workers)
        self.dataset = dataset
        self.sampler = sampler
        self._batches = _PositionBatches(sampler)
        generator = torch.Generator()  # DataLoader draws worker base seeds from it, not
        generator.manual_seed(sampler.seed & _M64)  # from the loop's global RNG
        self._loader = DataLoader(
            _SeededItems(dataset, sampler.seed), batch_sampler=self._batches, num_workers=num_workers,
            collate_fn=collate_fn, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=generator)
        self._it: Iterator | None = None
        self._next: tuple[int, int, int] | None = None  # (position, rank, world) of next(self._it)
        self.restarts = 0  # iterators started: 1 + rollbacks / regroupings seen

    def batch_at(self, position: int, rank: int, world_size: int) -> Any:
        """The collated batch of rank ``rank`` (of ``world_size``) at the step starting at
        global ``position``. The live iterator's next batch when that is the one asked
        for; otherwise the iterator restarts there. Raises ``DataError`` for a negative
        position or a rank outside [0, world_size)."""
        if position < 0:
            raise DataError(f"data position={position} must be >= 0: it counts the global samples consumed")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        want = (position, rank, world_size)
        if self._it is None or self._next != want:
            self._restart(position, rank, world_size)
        batch = next(self._it)
        self._next = (position + self.sampler.batch_size(world_size), rank, world_size)
        return batch

    def _restart(self, position: int, rank: int, world_size: int) -> None:
        self.sampler.order(position + rank * self.sampler.per_rank_batch, 1)  # range check
        if not self._loader.persistent_workers:
            self._stop()
        self._batches.start, self._batches.rank, self._batches.world = position, rank, world_size
        self._it = iter(self._loader)  # persistent workers: the same workers, reset
        self._next = None
        self.restarts += 1

    def _stop(self) -> None:
        it, self._it, self._next = self._it, None, None
        shutdown = getattr(it, "_shutdown_workers", None)  # multi-process iterators only
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        """Stop the worker processes (persistent ones included). Idempotent."""
        self._stop()
        persistent = getattr(self._loader, "_iterator", None)
        if persistent is not None:
            shutdown = getattr(persistent, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._loader._iterator = None

    def __enter__(self) -> "ResumableLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check(dataset: Any, sampler: Any, num_workers: int, prefetch_factor: int | None,
           persistent_workers: bool) -> None:
    if not isinstance(sampler, ResumableSampler):
        raise DataError(f"sampler must be a ResumableSampler, got {type(sampler).__name__}")
    if isinstance(dataset, IterableDataset):
        raise DataError(f"{type(dataset).__name__} is an IterableDataset: ResumableLoader needs a "
                        "map-style dataset (__getitem__ by index); see docs/data-loading.md")
    if not hasattr(dataset, "__getitem__"):
        raise DataError(f"{type(dataset).__name__} has no __getitem__: ResumableLoader needs a "
                        "map-style dataset")
    if hasattr(dataset, "__len__") and len(dataset) < sampler.num_samples:
        raise DataError(f"the dataset has {len(dataset)} samples but sampler.num_samples="
                        f"{sampler.num_samples}: it would read indices past the end")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise DataError(f"num_workers={num_workers!r} must be an integer >= 0")
    if prefetch_factor is not None and (num_workers == 0 or prefetch_factor < 1):
        raise DataError(f"prefetch_factor={prefetch_factor!r} needs num_workers >= 1 and must be >= 1")
    if persistent_workers and num_workers == 0:
        raise DataError("persistent_workers=True needs num_workers >= 1")
