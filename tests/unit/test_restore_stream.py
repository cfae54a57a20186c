"""Pure parts of the streamed peer restore: who sends to whom, and the chunk plan."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from slurm_resilience.worker.restore import (Piece, TensorSpec, assign_sources, choose_source,
                                             chunk_length, chunk_plan)


def test_receivers_spread_round_robin_over_the_newest_ranks():
    # a replaced node's ranks 4..7 (fresh, -1) restore from survivors 0..3 in parallel
    assert assign_sources([9, 9, 9, 9, -1, -1, -1, -1]) == {4: 0, 5: 1, 6: 2, 7: 3}
    assert assign_sources([9, -1, 9, 3, -1]) == {1: 0, 3: 2, 4: 0}


def test_ranks_at_the_newest_step_receive_nothing():
    assert assign_sources([5, 5, 5]) == {}
    assert assign_sources([-1, 0, -1]) == {0: 1, 2: 1}  # a snapshot at step 0 still wins


def test_assign_raises_like_choose_source():
    with pytest.raises(ValueError, match="no rank holds any state"):
        assign_sources([-1, -1])
    with pytest.raises(ValueError):
        assign_sources([])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 20), min_size=1, max_size=24))
def test_assignment_property(offers):
    if max(offers) < 0:
        return
    plan = assign_sources(offers)
    best = choose_source(offers).step
    sources = sorted({s for s in plan.values()})
    assert set(plan) == {r for r, o in enumerate(offers) if o < best}  # every stale rank, no other
    assert all(offers[s] == best for s in sources)
    loads = [list(plan.values()).count(s) for s in (r for r, o in enumerate(offers) if o == best)]
    assert not plan or max(loads) - min(loads) <= 1  # balanced
    assert plan == assign_sources(list(offers))  # deterministic


def test_chunk_plan_packs_and_splits():
    plan = chunk_plan([3, 0, 10, 2], 4)
    assert plan == [
        [Piece(0, 0, 3, 0), Piece(2, 0, 1, 3)],
        [Piece(2, 1, 4, 0)],
        [Piece(2, 5, 4, 0)],
        [Piece(2, 9, 1, 0), Piece(3, 0, 2, 1)],
    ]
    assert [chunk_length(c) for c in plan] == [4, 4, 4, 3]
    assert chunk_plan([], 4) == [] and chunk_plan([0, 0], 4) == []


def test_chunk_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_plan([1], 0)
    with pytest.raises(ValueError, match="negative"):
        chunk_plan([-1], 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 17))
def test_chunk_plan_covers_every_byte_once(sizes, chunk):
    plan = chunk_plan(sizes, chunk)
    seen = {i: [] for i in range(len(sizes))}
    for c in plan:
        assert 0 < chunk_length(c) <= chunk
        at = 0
        for p in c:  # pieces back to back from offset 0
            assert p.at == at and p.length > 0
            at += p.length
            seen[p.tensor].append((p.start, p.length))
    for i, size in enumerate(sizes):
        pos = 0
        for start, n in seen[i]:  # in order, no gap, no overlap
            assert start == pos
            pos += n
        assert pos == size
    assert all(chunk_length(c) == chunk for c in plan[:-1])  # only the last chunk is short
    assert len(plan) == -(-sum(sizes) // chunk)


def test_tensor_spec_bytes():
    assert TensorSpec("a", torch.bfloat16, (3, 5), False).nbytes == 30
    assert TensorSpec("b", torch.float64, (), False).nbytes == 8
    assert TensorSpec("c", torch.bool, (0, 4), False).nbytes == 0


def test_destinations_reuse_own_tensors_where_they_fit():
    from slurm_resilience.worker.restore import _destinations

    w = torch.zeros(4, 3)
    own = {"w": w, "tied": w, "h": torch.zeros(5).half(), "t": torch.zeros(3, 4).t()}
    index = [TensorSpec("w", torch.float32, (4, 3), False), TensorSpec("tied", torch.float32, (4, 3), False),
             TensorSpec("h", torch.float32, (5,), False), TensorSpec("t", torch.float32, (4, 3), False),
             TensorSpec("new", torch.int64, (2,), False)]
    out = _destinations(index, own, torch.device("cpu"))
    assert out[0] is w  # received in place
    assert out[1] is not w and out[1].data_ptr() != w.data_ptr()  # tied: one destination each
    assert out[2].dtype == torch.float32 and out[2].data_ptr() != own["h"].data_ptr()  # dtype differs
    assert out[3].is_contiguous() and out[3].data_ptr() != own["t"].data_ptr()  # non-contiguous own
    assert out[4].shape == (2,) and out[4].dtype == torch.int64
