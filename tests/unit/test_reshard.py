"""Resharding decisions (pure) checked against plain concatenate-and-slice."""

import pytest
import torch
from hypothesis import given, strategies as st

from slurm_resilience.worker.reshard import (
    SHARED, _assemble, assign_sources, choose_step, needed, plan_pieces, shard_range,
)


@given(st.integers(0, 500), st.integers(1, 17))
def test_shard_ranges_tile_the_whole_tensor(total, world):
    ranges = [shard_range(total, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_shard_range_rejects_nonsense():
    with pytest.raises(ValueError):
        shard_range(10, 0, 0)
    with pytest.raises(ValueError):
        shard_range(10, 2, 2)


@given(st.integers(1, 300), st.integers(1, 9), st.integers(1, 9))
def test_resharded_slices_equal_the_global_tensor_sliced_anew(total, old_world, new_world):
    g = torch.arange(total, dtype=torch.float64) * 1.5
    old = {r: g[slice(*shard_range(total, old_world, r))] for r in range(old_world)}
    totals = {"opt": {"m": total}}
    base = {"objects": {"opt": {"shards": {"m": old[0]}, "lr": 0.1}}, "step": 7}
    for rank in range(new_world):
        want = needed(totals, old_world, new_world, rank)
        olds = {o: {"objects": {"opt": {"shards": {"m": old[o]}}}} for o in want}
        got = _assemble(base, olds, totals, old_world, new_world, rank, ["opt"])
        assert torch.equal(got["objects"]["opt"]["shards"]["m"], g[slice(*shard_range(total, new_world, rank))])
        assert got["objects"]["opt"]["lr"] == 0.1 and got["step"] == 7
    assert base["objects"]["opt"]["shards"]["m"] is old[0]  # the base state is not modified


def test_pieces_of_a_three_to_two_reshard():
    # 10 elements: old slices 4,3,3; new slices 5,5
    assert [(p.old_rank, p.src, p.dst, p.count) for p in plan_pieces([4, 3, 3], 2, 0)] == [(0, 0, 0, 4), (1, 0, 4, 1)]
    assert [(p.old_rank, p.src, p.dst, p.count) for p in plan_pieces([4, 3, 3], 2, 1)] == [(1, 1, 0, 2), (2, 0, 2, 3)]


def test_choose_step_needs_every_old_shard_somewhere():
    held = {0: [(20, 0), (20, 2), (10, 0)], 1: [(20, 1), (10, 1)]}
    assert choose_step(held, shared={}, worlds={20: 3, 10: 3}) == 20
    held = {0: [(20, 0), (10, 0), (10, 2)], 1: [(10, 1)]}  # step 20's shards 1 and 2 are lost
    assert choose_step(held, shared={}, worlds={20: 3, 10: 3}) == 10
    assert choose_step(held, shared={15: 3}, worlds={20: 3, 10: 3}) == 15  # the shared tier has all
    assert choose_step({0: [(5, 0)]}, shared={}, worlds={5: 2}) is None


def test_sources_are_the_lowest_holder_or_the_shared_tier():
    held = {0: [(20, 2)], 1: [(20, 0), (20, 1)], 2: [(20, 0)]}
    assert assign_sources(held, 20, 3, on_shared=False) == [1, 1, 0]
    assert assign_sources(held, 20, 3, on_shared=True) == [SHARED] * 3
