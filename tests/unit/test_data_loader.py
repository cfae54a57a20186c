"""ResumableLoader (data/loader.py): real DataLoader workers, batches a pure function of
(seed, position, rank, world size), per-sample RNG included, and no leaked workers."""

import multiprocessing
import random
import types

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from slurm_resilience import ResumableLoader, ResumableSampler
from slurm_resilience.data.loader import sample_seed
from slurm_resilience.errors import DataError, ResilienceError
from slurm_resilience.worker.step import Step

N = 53  # a prime: batches straddle epoch boundaries


class Augmented(Dataset):
    """Index plus noise from all three RNGs an augmentation might use."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        noise = torch.rand(2, dtype=torch.float64).tolist() + [random.random(), float(np.random.rand())]
        return torch.tensor([float(i)] + noise, dtype=torch.float64)


class Plain(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


def _steps(loader, world, rank, steps, start=0):
    B = loader.sampler.batch_size(world)
    return [loader.batch_at(start + k * B, rank, world) for k in range(steps)]


@pytest.fixture(scope="module")
def continuous():
    """Rank 1 of 3, 12 consecutive steps with num_workers=0: the reference."""
    s = ResumableSampler(N, 4, seed=11)
    with ResumableLoader(Augmented(), s) as loader:
        return _steps(loader, 3, 1, 12)


def test_batch_holds_the_samplers_indices(continuous):
    s = ResumableSampler(N, 4, seed=11)
    for k, batch in enumerate(continuous):
        assert batch[:, 0].long().tolist() == s.indices_at(k * 12, 1)


@pytest.mark.parametrize("persistent", [False, True])
def test_two_workers_give_the_same_bits_and_resume_anywhere(continuous, persistent):
    s = ResumableSampler(N, 4, seed=11)
    with ResumableLoader(Augmented(), s, num_workers=2, prefetch_factor=3, persistent_workers=persistent) as loader:
        live = _steps(loader, 3, 1, 12)
        assert loader.restarts == 1  # consecutive steps came from the live iterator
        assert all(torch.equal(a, b) for a, b in zip(live, continuous))
        for k in (7, 8, 2, 2, 11, 0):  # rollbacks and jumps: a fresh iterator at that position
            assert torch.equal(loader.batch_at(k * 12, 1, 3), continuous[k])
        assert loader.restarts == 6  # all but 8 (the live iterator's next) restarted


def test_resume_in_a_fresh_loader_equals_the_continuous_run(continuous):
    s = ResumableSampler(N, 4, seed=11)
    for k in (0, 5, 9):
        with ResumableLoader(Augmented(), s) as loader:  # a restart after a requeue
            resumed = _steps(loader, 3, 1, 12 - k, start=k * 12)
        assert all(torch.equal(a, b) for a, b in zip(resumed, continuous[k:]))


def test_randomness_depends_on_position_not_worker_or_epoch_index():
    s = ResumableSampler(N, 1, seed=4)
    with ResumableLoader(Augmented(), s) as loader:
        a, b = loader.batch_at(0, 0, 1), loader.batch_at(N, 0, 1)  # same-rank, epochs 0 and 1
    assert not torch.equal(a[:, 1:], b[:, 1:])  # a sample seen again gets a fresh augmentation
    assert sample_seed(4, 0) != sample_seed(4, N) != sample_seed(5, N)


@pytest.mark.parametrize("workers", [0, 2])
def test_scale_in_4_to_3_continues_with_exactly_the_next_samples(workers):
    s = ResumableSampler(N, 3, seed=2)
    before, after = 5, 6  # 5 steps of world 4, then world 3 from position 60
    with ResumableLoader(Plain(), s, num_workers=workers) as loader:
        seen = [i for k in range(before) for r in range(4) for i in loader.batch_at(k * 12, r, 4).tolist()]
        p = before * 12
        seen += [i for k in range(after) for r in range(3) for i in loader.batch_at(p + k * 9, r, 3).tolist()]
    assert seen == s.order(0, p + after * 9).tolist()  # nothing skipped, nothing repeated
    assert sorted(seen[:N]) == list(range(N))


def test_the_loops_global_rng_is_untouched():
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    with ResumableLoader(Augmented(), ResumableSampler(N, 4, seed=1)) as loader:
        _steps(loader, 2, 0, 3)
        loader.batch_at(0, 1, 2)  # a restart draws the workers' base seed: not from the global RNG
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def _children():
    return {p.pid: p for p in multiprocessing.active_children()}


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_do_not_leak(persistent):
    before = set(_children())
    loader = ResumableLoader(Plain(), ResumableSampler(N, 2), num_workers=2, persistent_workers=persistent)
    with loader:
        for k in (0, 1, 5, 0, 3):  # restarts: old workers must go (or be reused)
            loader.batch_at(k * 2, 0, 1)
            workers = {pid: p for pid, p in _children().items() if pid not in before}
            assert len(workers) == 2
    assert all(not p.is_alive() for p in workers.values())
    assert set(_children()) <= before
    loader.close()  # idempotent


def test_step_batch_uses_the_steps_position_and_sets_consumed():
    s = ResumableSampler(N, 4, seed=9)
    session = types.SimpleNamespace(rank=2, world_size=3, position=36)
    step = Step(session, index=3)
    with ResumableLoader(Plain(), s) as loader:
        batch = step.batch(loader)
    assert batch.tolist() == s.indices_at(36, 2)
    assert step.consumed == 12


def _one_line_data_error(fn):
    with pytest.raises(DataError) as e:
        fn()
    assert isinstance(e.value, ResilienceError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_workers=-1), "num_workers"),
    (dict(prefetch_factor=2), "prefetch_factor"),
    (dict(num_workers=1, prefetch_factor=0), "prefetch_factor"),
    (dict(persistent_workers=True), "persistent_workers"),
])
def test_bad_loader_arguments(kwargs, match):
    assert match in _one_line_data_error(lambda: ResumableLoader(Plain(), ResumableSampler(N, 2), **kwargs))


def test_bad_datasets_and_samplers():
    assert "IterableDataset" in _one_line_data_error(lambda: ResumableLoader(Stream(), ResumableSampler(N, 2)))
    assert "num_samples=100" in _one_line_data_error(lambda: ResumableLoader(Plain(), ResumableSampler(100, 2)))
    assert "ResumableSampler" in _one_line_data_error(lambda: ResumableLoader(Plain(), list(range(N))))
    assert "__getitem__" in _one_line_data_error(lambda: ResumableLoader(object(), ResumableSampler(N, 2)))


@pytest.mark.parametrize("position,rank,world,match", [
    (-4, 0, 1, "position"), (0, 3, 3, "rank"), (0, -1, 2, "rank"), (0, 0, 0, "rank"), (2**63 - 2, 0, 1, "position"),
])
def test_bad_positions_and_ranks(position, rank, world, match):
    with ResumableLoader(Plain(), ResumableSampler(N, 2)) as loader:
        assert match in _one_line_data_error(lambda: loader.batch_at(position, rank, world))
        assert loader.batch_at(0, 0, 1).tolist() == ResumableSampler(N, 2).indices_at(0, 0)  # still usable
