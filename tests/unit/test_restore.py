import pytest
import torch
from hypothesis import given, settings, strategies as st

from slurm_resilience.worker.restore import RestorePlan, choose_source, deserialize, serialize


def test_newest_step_wins():
    assert choose_source([5, 9, 7]) == RestorePlan(source_rank=1, step=9)


def test_lowest_rank_among_ties():
    assert choose_source([-1, 8, 3, 8, 8]) == RestorePlan(source_rank=1, step=8)
    assert choose_source([4, 4, 4]) == RestorePlan(source_rank=0, step=4)


def test_fresh_rank_with_snapshot_can_be_source():
    assert choose_source([-1, -1, 0]) == RestorePlan(source_rank=2, step=0)


def test_nobody_holds_state_raises():
    with pytest.raises(ValueError, match="no rank holds any state"):
        choose_source([-1, -1, -1])


def test_empty_raises():
    with pytest.raises(ValueError):
        choose_source([])


def test_tuple_offers():
    assert choose_source((3, 1)).source_rank == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 50), min_size=1, max_size=16))
def test_choose_source_property(offers):
    if max(offers) < 0:
        with pytest.raises(ValueError):
            choose_source(offers)
        return
    p = choose_source(offers)
    assert p.step == max(offers) and offers[p.source_rank] == p.step
    assert all(o < p.step for o in offers[: p.source_rank])


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        # bit-exact: compare the raw bytes (NaN payloads and -0.0 included)
        assert a.contiguous().view(torch.uint8).tolist() == b.contiguous().view(torch.uint8).tolist()
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def test_roundtrip_bit_exact_nested():
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.14159])
    state = {
        "step": 17,
        "objects": {
            "model": {"w": torch.randn(4, 5, generator=g), "b": torch.randn(5, generator=g).double()},
            "optimizer": {"state": {0: {"momentum_buffer": torch.randn(3, generator=g)}},
                          "param_groups": [{"lr": 0.05, "params": [0]}]},
        },
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, generator=g).half(),
        "special": special,
        "special_bf16": special.to(torch.bfloat16),
        "ints": torch.arange(-3, 3, dtype=torch.int64),
        "bools": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "noncontig": torch.arange(12.0).view(3, 4).t(),
        "rng": torch.get_rng_state(),
        "meta": ("a", 1, None, [1.5, {"x": "y"}]),
    }
    data = serialize(state)
    assert data.dtype == torch.uint8 and data.dim() == 1
    back = deserialize(data)
    _same(state, back)
    assert back["objects"]["model"]["b"].dtype == torch.float64
    assert torch.equal(back["noncontig"], state["noncontig"])


def test_deserialize_from_a_copy():
    """The receiving side gets a fresh uint8 tensor (as after a broadcast)."""
    state = {"x": torch.randn(10).to(torch.bfloat16)}
    data = serialize(state)
    received = torch.empty(data.numel(), dtype=torch.uint8)
    received.copy_(data)
    _same(state, deserialize(received))


def test_serialized_tensors_do_not_alias():
    w = torch.zeros(3)
    back = deserialize(serialize({"w": w}))
    back["w"].add_(1)
    assert torch.equal(w, torch.zeros(3))
