"""The pure parts of the ULFM path: repair plans, buddies, state packing, the ULFM check."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, strategies as st

from slurm_resilience.mpi.errors import StateLostError, StateMismatchError, UlfmUnavailableError
from slurm_resilience.mpi.lifecycle import Phase, PhaseError, transition
from slurm_resilience.mpi.plan import SPARE, Member, buddy, buddy_source, plan_repair, rollback_step
from slurm_resilience.mpi.snapshot import Layout
from slurm_resilience.mpi.ulfm import require_ulfm


def world(size: int, spares: int, lost_wids=(), committed=None) -> list[Member]:
    committed = committed or {}
    return [Member(w, w if w < size else SPARE, committed.get(w, 10) if w < size else -1)
            for w in range(size + spares) if w not in lost_wids]


def test_spare_takes_the_lost_rank_and_survivors_keep_theirs():
    plan = plan_repair(world(4, 1, lost_wids=[2]), size=4, per_node=1)
    assert plan.size == 4 and plan.lost == (2,) and plan.scaled_in == ()
    assert plan.promoted == {4: 2}
    assert dict(plan.new_rank) == {0: 0, 1: 1, 3: 3, 4: 2}
    assert plan.sources == {2: 3}  # rank 2's copy lives on its buddy, rank 3
    assert plan.step == 10


def test_no_spare_left_scales_in_keeping_order():
    plan = plan_repair(world(4, 0, lost_wids=[1]), size=4, per_node=1)
    assert plan.size == 3 and plan.scaled_in == (1,) and plan.promoted == {}
    assert dict(plan.new_rank) == {0: 0, 2: 1, 3: 2}
    assert plan.sources == {}


def test_more_lost_than_spares_fills_the_lowest_then_scales_in():
    plan = plan_repair(world(4, 1, lost_wids=[1, 3]), size=4, per_node=1)
    assert plan.promoted == {4: 1} and plan.scaled_in == (3,)
    assert dict(plan.new_rank) == {0: 0, 4: 1, 2: 2}
    assert plan.sources == {1: 2}


def test_a_lost_spare_is_no_loss():
    plan = plan_repair(world(4, 2, lost_wids=[4]), size=4, per_node=1)
    assert plan.lost == () and plan.promoted == {} and plan.rank_of(5) == SPARE


def test_rank_and_its_buddy_both_lost_is_state_lost():
    with pytest.raises(StateLostError, match="rank 1 and the buddy"):
        plan_repair(world(4, 2, lost_wids=[1, 2]), size=4, per_node=1)


def test_every_active_rank_lost():
    with pytest.raises(StateLostError):
        plan_repair(world(2, 1, lost_wids=[0, 1]), size=2, per_node=1)


def test_rollback_is_the_last_step_every_survivor_committed():
    members = world(4, 1, lost_wids=[2], committed={0: 11, 1: 10, 3: 11})
    assert rollback_step(members) == 10
    assert plan_repair(members, 4, 1).step == 10


def test_buddy_is_on_the_next_node():
    assert [buddy(r, 8, 2) for r in range(8)] == [2, 3, 4, 5, 6, 7, 0, 1]
    assert [buddy(r, 2, 2) for r in range(2)] == [1, 0]  # one node: the next rank
    with pytest.raises(ValueError):
        buddy(4, 4, 1)


@given(size=st.integers(1, 12), per_node=st.integers(1, 4), data=st.data())
def test_plan_invariants(size, per_node, data):
    spares = data.draw(st.integers(0, 4))
    lost = data.draw(st.sets(st.integers(0, size + spares - 1), max_size=size + spares))
    members = world(size, spares, lost_wids=lost)
    try:
        plan = plan_repair(members, size, per_node)
    except StateLostError:
        return
    ranks = sorted(plan.new_rank.values())
    assert ranks == list(range(plan.size))  # every slot filled once
    survivors = {m.wid for m in members if m.rank != SPARE}
    if not plan.scaled_in:
        assert all(plan.new_rank[w] == w for w in survivors)  # survivors keep their rank
        assert plan.size == size
    for dst, src in plan.sources.items():
        holder = next(w for w, r in plan.new_rank.items() if r == src)
        assert holder in survivors
    for r in range(size):
        assert buddy_source(buddy(r, size, per_node), size, per_node) == r


def test_layout_round_trip_in_place():
    w = np.arange(12, dtype=np.float64).reshape(3, 4)
    pos = np.array([7], dtype=np.int64)
    lay = Layout({"w": w, "pos": pos})
    buf = lay.pack()
    w_ref, pos_ref = w, pos
    w[...] = -1
    pos[0] = 0
    lay.unpack_into(buf)
    assert w_ref is w and (w == np.arange(12).reshape(3, 4)).all() and pos[0] == 7
    with pytest.raises(StateMismatchError):
        lay.unpack_into(buf[:-1])


def test_layout_refuses_what_it_cannot_copy():
    with pytest.raises(StateMismatchError, match="contiguous"):
        Layout({"w": np.zeros((4, 4))[:, 1]})
    with pytest.raises(StateMismatchError, match="numpy arrays"):
        Layout({"w": [1.0, 2.0]})
    with pytest.raises(StateMismatchError):
        Layout({})


def test_layout_takes_cpu_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32)
    lay = Layout({"t": t})
    buf = lay.pack()
    t.zero_()
    lay.unpack_into(buf)
    assert t.tolist() == [0, 1, 2, 3, 4, 5]


def test_require_ulfm():
    mpi = types.SimpleNamespace(Comm=types.SimpleNamespace(Shrink=None), ERR_PROC_FAILED=75)
    require_ulfm({"OMPI_MCA_mpi_ft_enable": "1"}, mpi)
    with pytest.raises(UlfmUnavailableError, match="--with-ft ulfm"):
        require_ulfm({}, mpi)
    old = types.SimpleNamespace(Comm=types.SimpleNamespace())
    with pytest.raises(UlfmUnavailableError, match="mpi4py>=4"):
        require_ulfm({"OMPI_MCA_mpi_ft_enable": "1"}, old)
    assert "\n" not in str(UlfmUnavailableError("x"))


def test_phase_transitions():
    assert transition(Phase.PARKED, Phase.REPAIRING) is Phase.REPAIRING
    assert transition(Phase.REPAIRING, Phase.PARKED) is Phase.PARKED
    with pytest.raises(PhaseError):
        transition(Phase.DONE, Phase.ACTIVE)
    with pytest.raises(PhaseError):
        transition(Phase.PARKED, Phase.ACTIVE)
