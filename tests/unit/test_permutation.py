"""The O(1)-memory keyed permutation (data/permutation.py) and the sampler built on it."""

import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from slurm_resilience.data.permutation import half_bits, permute, reference
from slurm_resilience.data.sampler import ResumableSampler
from slurm_resilience.errors import DataError, ResilienceError

SIZES = sorted({1, 2, 3, 4, 5, 7, 13, 31, 97, 101, 1009, 8191, 65537}
               | {2**k + d for k in range(1, 15) for d in (-1, 0, 1)})


@pytest.mark.parametrize("n", SIZES)
def test_is_a_permutation_of_range_n(n):
    for seed, epoch in ((0, 0), (7, 3)):
        out = permute(np.arange(n), n, seed, epoch)
        assert out.dtype == np.int64
        assert np.array_equal(np.sort(out), np.arange(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(-2**70, 2**70), epoch=st.integers(0, 10**6))
def test_any_n_seed_epoch_gives_a_permutation(n, seed, epoch):
    out = permute(np.arange(n), n, seed, epoch)
    assert np.array_equal(np.sort(out), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**64), epoch=st.integers(0, 1000))
def test_vectorised_equals_the_plain_reference(n, seed, epoch):
    assert permute(np.arange(n), n, seed, epoch).tolist() == [reference(i, n, seed, epoch) for i in range(n)]


def test_reference_on_a_large_n_at_a_few_offsets():
    n = 10**9 + 7
    offsets = [0, 1, 12345, n // 2, n - 1]
    assert permute(offsets, n, 42, 9).tolist() == [reference(i, n, 42, 9) for i in offsets]


def test_order_does_not_depend_on_which_offsets_are_asked_together():
    n = 1000
    whole = permute(np.arange(n), n, 5, 2)
    assert permute([17, 3, 999], n, 5, 2).tolist() == [whole[17], whole[3], whole[999]]


@pytest.mark.parametrize("n", [10, 97, 1024, 5000])
def test_seeds_and_epochs_give_different_orders(n):
    orders = {tuple(permute(np.arange(n), n, seed, epoch).tolist()) for seed in range(4) for epoch in range(4)}
    assert len(orders) == 16
    assert tuple(range(n)) not in orders  # not the identity


def test_half_bits_is_the_smallest_power_of_four():
    for n in SIZES:
        k = half_bits(n)
        assert 4**k >= n and (k == 1 or 4 ** (k - 1) < n)


@pytest.mark.parametrize("n,offsets", [(0, []), (2**62 + 1, [0]), (10, [10]), (10, [-1])])
def test_out_of_range_raises(n, offsets):
    with pytest.raises(ValueError):
        permute(offsets, n, 0, 0)


def test_billion_samples_fast_and_no_n_sized_allocation():
    s = ResumableSampler(num_samples=10**9, per_rank_batch=256, seed=3)
    s.indices_at(0, 0)  # warm numpy's code paths
    tracemalloc.start()
    t0 = time.perf_counter()
    shares = [s.indices_at(p, r) for p in (0, 10**9 - 100, 5 * 10**12 + 17) for r in range(4)]
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000  # an epoch's list would be ~8 GB; one batch is ~2 kB
    assert elapsed < 5.0  # generous for a loaded box; an epoch shuffle at 1e9 takes minutes
    assert all(len(sh) == 256 and all(0 <= i < 10**9 for i in sh) for sh in shares)
    # a share straddling the epoch boundary: the end of epoch 0 then the start of epoch 1
    edge = s.indices_at(10**9 - 100, 0)
    assert edge[:100] == permute(np.arange(10**9 - 100, 10**9), 10**9, 3, 0).tolist()
    assert edge[100:] == permute(np.arange(156), 10**9, 3, 1).tolist()


@pytest.mark.parametrize("kwargs", [dict(num_samples=0, per_rank_batch=1), dict(num_samples=4, per_rank_batch=0),
                                    dict(num_samples=2**62 + 1, per_rank_batch=1),
                                    dict(num_samples=4.0, per_rank_batch=1), dict(num_samples=4, per_rank_batch=True)])
def test_sampler_bad_args_are_one_line_data_errors(kwargs):
    with pytest.raises(DataError) as e:
        ResumableSampler(**kwargs)
    assert isinstance(e.value, ResilienceError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("position,rank", [(-1, 0), (0, -1), (2**63, 0)])
def test_sampler_bad_position_or_rank(position, rank):
    with pytest.raises(DataError, match="position|rank"):
        ResumableSampler(num_samples=10, per_rank_batch=2).indices_at(position, rank)


def test_positional_constructor_and_old_import_path():
    from slurm_resilience import ResumableSampler as top
    from slurm_resilience.worker.rollback import ResumableSampler as old
    assert top is old is ResumableSampler
    assert ResumableSampler(10, 2, 1, False) == ResumableSampler(num_samples=10, per_rank_batch=2, seed=1, shuffle=False)
