"""FSDP2 state as the toolkit's sharded convention: the "rows" split against torch.chunk,
resharding of rows layouts, totals from layouts, and the nested state round trip through
a real fully_shard model (one gloo rank in this process)."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from torch import nn

from slurm_resilience.errors import ResilienceError
from slurm_resilience.worker import fsdp_state as fs
from slurm_resilience.worker.fsdp import RebuiltFSDP
from slurm_resilience.worker.rebind import GenerationHooks
from slurm_resilience.worker.reshard import _assemble, needed, plan_pieces, shard_meta, slice_range


def _rows(shape):
    return {"shape": list(shape), "split": "rows"}


@given(st.integers(0, 23), st.integers(0, 4), st.integers(1, 9))
def test_rows_slices_are_torch_chunk_on_dim0(rows, cols, world):
    g = torch.arange(rows * max(cols, 1), dtype=torch.float32).reshape(rows, max(cols, 1))[:, :cols]
    g = g.contiguous()
    chunks = list(torch.chunk(g, world, dim=0)) if rows else []
    flat = g.reshape(-1)
    for r in range(world):
        a, b = slice_range(_rows(g.shape), g.numel(), world, r)
        want = chunks[r].reshape(-1) if r < len(chunks) else flat[:0]  # trailing ranks: nothing
        assert torch.equal(flat[a:b], want)
        assert fs.local_shape(_rows(g.shape), world, r)[0] * cols == b - a
    ends = [slice_range(_rows(g.shape), g.numel(), world, r) for r in range(world)]
    assert ends[0][0] == 0 and ends[-1][1] == g.numel() and all(x[1] == y[0] for x, y in zip(ends, ends[1:]))


def test_slice_range_rejects_a_layout_that_does_not_match_the_total():
    assert slice_range(None, 10, 3, 0) == (0, 4) and slice_range({"split": "even"}, 10, 3, 2) == (7, 10)
    assert slice_range(_rows([7, 5]), 35, 3, 2) == (30, 35)  # rows 3, 3, 1
    for bad in (_rows([7, 5]), _rows([]), {"shape": [4], "split": "cols"}):
        with pytest.raises(ValueError):
            slice_range(bad, 34, 3, 0)


@settings(max_examples=60)
@given(st.integers(0, 13), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6))
def test_rows_reshard_equals_the_global_tensor_chunked_anew(rows, cols, old_world, new_world):
    g = torch.randn(rows, cols, dtype=torch.float64)
    flat, layout = g.reshape(-1), _rows([rows, cols])
    layouts, totals = {"m": {"w": layout}}, {"m": {"w": g.numel()}}
    old = {r: flat[slice(*slice_range(layout, g.numel(), old_world, r))] for r in range(old_world)}
    base = {"objects": {"m": {"shards": {"w": old[0]}, "nested": True}}, "shard_layouts": layouts}
    for rank in range(new_world):
        want = needed(totals, old_world, new_world, rank, layouts)
        got = _assemble(base, {o: {"objects": {"m": {"shards": {"w": old[o]}}}} for o in want},
                        totals, old_world, new_world, rank, ["m"], layouts)["objects"]["m"]["shards"]["w"]
        assert torch.equal(got, flat[slice(*slice_range(layout, g.numel(), new_world, rank))])
    lens = [len(old[r]) for r in range(old_world)]
    assert sum(p.count for r in range(new_world) for p in plan_pieces(lens, new_world, r, layout)) == g.numel()


def test_totals_come_from_layouts_so_late_keys_are_covered():
    states = {"opt": {"shards": {"state/w/exp_avg": torch.zeros(3), "m": torch.zeros(2)},
                      "layouts": {"state/w/exp_avg": _rows([7, 5])}}}
    totals, layouts = shard_meta(states, {"opt": {"m": 5}})
    assert totals == {"opt": {"state/w/exp_avg": 35, "m": 5}}
    assert layouts == {"opt": {"state/w/exp_avg": _rows([7, 5])}}
    assert shard_meta({"opt": {"shards": {"m": torch.zeros(2)}}}, {}) == ({"opt": {}}, {})


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _build(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _wrapper(build, gen=lambda: 0):
    from torch.distributed.device_mesh import init_device_mesh

    return RebuiltFSDP(build, mesh=lambda: init_device_mesh("cpu", (1,)), generation=gen,
                       world_size=lambda: 1, hooks=GenerationHooks(), park=lambda _: None)


def test_nested_state_round_trip_through_a_rebuild(one_rank):
    gen = [0]
    f = _wrapper(_build, lambda: gen[0])
    f(torch.randn(3, 4)).sum().backward()
    f.optimizer.step()
    model_sd, opt_sd = f.state_of("model"), f.state_of("optimizer")
    assert model_sd["nested"] and model_sd["layouts"]["0.weight"] == _rows([5, 4])
    assert set(opt_sd["shards"]) == {f"state/{k}/{s}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")
                                     for s in ("exp_avg", "exp_avg_sq")}
    assert "exp_avg" not in opt_sd["replicated"]["state"]["0.weight"]  # sharded leaves left out
    before = {k: v.clone() for k, v in model_sd["shards"].items()}
    rng = torch.get_rng_state()
    gen[0] = 1
    old = f.model
    f.rebuild()  # a new generation: built anew, the live state loaded into it
    assert f.model is not old and f.builds == 2 and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in f.model.parameters())
    after = f.state_of("model")
    assert all(torch.equal(after["shards"][k], before[k]) for k in before)
    assert torch.equal(f.state_of("optimizer")["shards"]["state/2.weight/exp_avg"],
                       opt_sd["shards"]["state/2.weight/exp_avg"])
    full = fs.join_tree(f.state_of("model"), lambda p, t, lay: t.view(lay["shape"]))
    assert torch.equal(full["0.weight"], old[0].weight.full_tensor())

    # an imported state (checkpoint.init_from) may hold full plain tensors where the template
    # had no sharded key yet: they are distributed as this rank's rows
    opt_sd = f.state_of("optimizer")
    full_opt = fs.join_tree(opt_sd, lambda p, t, lay: t.view(lay["shape"]).clone())
    f.pending["optimizer"] = {"nested": True, "shards": {}, "layouts": {}, "replicated": full_opt}
    gen[0] = 2
    f.rebuild()
    again = f.state_of("optimizer")
    assert set(again["shards"]) == set(opt_sd["shards"])
    assert all(torch.equal(again["shards"][k], opt_sd["shards"][k]) for k in opt_sd["shards"])
    # loaded through the registered part (a restore or import), they are cut into rows at once
    f.parts()[0]["optimizer"].load_state_dict({"nested": True, "shards": {}, "layouts": {}, "replicated": full_opt})
    pending = f.state_of("optimizer")
    assert set(pending["shards"]) == set(opt_sd["shards"]) and pending["layouts"] == opt_sd["layouts"]
    assert "exp_avg" not in pending["replicated"]["state"]["0.weight"]


def test_full_leaves_of_an_import_become_this_ranks_rows():
    w, m = torch.arange(35.0).reshape(7, 5), torch.arange(7.0)
    state = {"nested": True, "shards": {}, "layouts": {},
             "replicated": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": w, "odd": torch.zeros(5, 7)},
                                      "b": {"exp_avg": m}},
                            "param_groups": [{"params": ["w", "b"], "lr": 0.1}]}}
    shapes = {"w": [7, 5], "b": [7]}
    out = fs.shard_full_leaves(state, shapes, 3, 2)  # rows 3, 3, 1: rank 2 holds row 6
    assert out["shards"].keys() == {"state/w/exp_avg", "state/b/exp_avg"}
    assert torch.equal(out["shards"]["state/w/exp_avg"], w[6:].reshape(-1))
    assert torch.equal(out["shards"]["state/b/exp_avg"], m[6:])
    assert out["layouts"]["state/w/exp_avg"] == _rows([7, 5])
    rep = out["replicated"]
    assert rep["state"]["w"].keys() == {"step", "odd"} and rep["state"]["b"] == {}  # wrong shape: stays
    assert rep["param_groups"] == state["replicated"]["param_groups"] and "exp_avg" in state["replicated"]["state"]["w"]
    model = fs.shard_full_leaves({"nested": True, "shards": {}, "replicated": {"w": w, "buf": m}}, shapes, 2, 0)
    assert torch.equal(model["shards"]["w"], w[:4].reshape(-1)) and model["replicated"] == {"buf": m}


def test_bad_builds_are_one_line_errors(one_rank):
    def plain(mesh):
        return nn.Linear(2, 2)

    def four(mesh):
        return (*_build(mesh), None, None)

    def wrong_opt(mesh):
        return _build(mesh)[0], "adam"

    def hsdp(mesh):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        return fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("r", "s")))

    for build, msg in ((plain, "wrapped with fully_shard"), (four, "got 4 values"),
                       (wrong_opt, "torch.optim.Optimizer"), (hsdp, "only fully_shard on a 1-D mesh"),
                       (42, "callable")):
        with pytest.raises(ResilienceError, match=msg) as info:
            _wrapper(build)
        assert "\n" not in str(info.value)
