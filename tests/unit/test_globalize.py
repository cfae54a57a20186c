"""globalize.py (slices -> global tensors, nested reassembly) and dcp_io.py (export,
init_from) on real files: HDF5 shards written by hdf5_format, DCP read by torch."""

import os
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.dcp_io import check_init_from, initial_state, read_dcp, write_dcp
from slurm_resilience.checkpoint.globalize import (global_object_state, global_state, local_object_state,
                                                   plain_extras, read_rank_states, slice_range)
from slurm_resilience.checkpoint.hdf5_format import shard_crc32, write_shard
from slurm_resilience.cli import main
from slurm_resilience.config import load_config
from slurm_resilience.errors import CheckpointError, ConfigError



def _even(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    flat = t.reshape(-1)
    return [flat[a:b].clone() for a, b in (slice_range({"split": "even"}, flat.numel(), world, r)
                                           for r in range(world))]


def _rank_states(world=3, nested=False, step=20):
    """What `world` ranks' checkpoints hold: a replicated model, a 1-D even sharded
    optimizer, and (nested) an FSDP-style object with a rows-split 2-D leaf."""
    torch.manual_seed(1)
    model = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    mom = torch.randn(11)
    big = torch.randn(7, 2)  # 7 rows over 3 ranks: 3, 3, 1 (torch.chunk)
    exp = torch.randn(7, 2)
    rows = {"shape": [7, 2], "split": "rows"}
    states = []
    for r in range(world):
        objs = {"model": model, "optim": {"shards": {"momentum": _even(mom, world)[r]}, "lr": 0.1}}
        st = {"step": step, "position": 99, "rng": {}, "extras": {"epoch": 2, "arr": object()},
              "objects": objs, "shard_totals": {"optim": {"momentum": 11}}}
        if nested:
            sl = lambda t: t.reshape(-1)[slice(*slice_range(rows, 14, world, r))].clone()  # noqa: E731
            objs["fsdp"] = {"nested": True, "shards": {"0.weight": sl(big), "state/0.weight/exp_avg": sl(exp)},
                            "replicated": {"state": {"0.weight": {"step": torch.tensor(5.0)}},
                                           "param_groups": [{"lr": 0.01, "params": ["0.weight"]}]}}
            st["shard_totals"]["fsdp"] = {"0.weight": 14, "state/0.weight/exp_avg": 14}
            st["shard_layouts"] = {"fsdp": {"0.weight": rows, "state/0.weight/exp_avg": rows}}
        states.append(st)
    return states, model, mom, big, exp


def test_slice_range_rows_like_torch_chunk():
    for rows, world in [(7, 3), (2, 3), (0, 2), (8, 4), (5, 1)]:
        lay = {"shape": [rows, 3], "split": "rows"}
        got = [slice_range(lay, rows * 3, world, r) for r in range(world)]
        chunks = list(torch.arange(rows * 3).reshape(rows, 3).chunk(world)) if rows else []
        want = [c.reshape(-1) for c in chunks] + [torch.empty(0, dtype=torch.int64)] * (world - len(chunks))
        flat = torch.arange(rows * 3)
        assert [flat[a:b].tolist() for a, b in got] == [w.tolist() for w in want]
    assert [slice_range({"split": "even"}, 7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError):
        slice_range({"split": "diagonal"}, 4, 2, 0)


def test_global_object_state_even_rows_and_nested():
    states, model, mom, big, exp = _rank_states(nested=True)
    assert global_object_state(states, "model") is states[0]["objects"]["model"]
    opt = global_object_state(states, "optim")
    assert torch.equal(opt["shards"]["momentum"], mom) and opt["lr"] == 0.1
    full = global_object_state(states, "fsdp")
    assert torch.equal(full["0.weight"], big) and torch.equal(full["state"]["0.weight"]["exp_avg"], exp)
    assert full["state"]["0.weight"]["step"] == 5.0 and full["param_groups"][0]["lr"] == 0.01
    assert "exp_avg" not in states[0]["objects"]["fsdp"]["replicated"]["state"]["0.weight"]  # not mutated
    g = global_state(states)
    assert (g["step"], g["position"], g["extras"]) == (20, 99, {"epoch": 2})  # object() is not plain


def test_local_object_state_round_trips_at_any_world():
    states, *_ = _rank_states(nested=True)
    full = {n: global_object_state(states, n) for n in ("optim", "fsdp")}
    for world in (1, 2, 3, 5):
        again, _, _, _, _ = _rank_states(world=world, nested=True)
        for r in range(world):
            lay = again[r]["shard_layouts"]["fsdp"]
            for name, layouts in (("optim", None), ("fsdp", lay)):
                mine = local_object_state(full[name], again[r]["objects"][name], None, layouts, world, r)
                want = again[r]["objects"][name]
                for k, t in want["shards"].items():
                    assert torch.equal(mine["shards"][k], t), (world, r, name, k)
            assert "0.weight" not in mine["replicated"] and mine["nested"] is True


def test_slices_that_do_not_add_up_are_refused():
    states, *_ = _rank_states()
    states[1]["objects"]["optim"]["shards"]["momentum"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="slices hold"):
        global_object_state(states, "optim")
    with pytest.raises(CheckpointError, match="no object 'nope'"):
        global_object_state(states, "nope")


def test_plain_extras():
    assert plain_extras({"a": (1, 2.5), "b": {"c": None}, "d": {1: 2}, "e": b"x"}) == {"a": [1, 2.5], "b": {"c": None}}


def _write_tier(root, states, step=20):
    shards = {}
    for r, st in enumerate(states):
        path = mf.shard_path(str(root), step, r)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_shard(path, st)
        shards[r] = mf.ShardRecord(mf.shard_name(r), os.path.getsize(path), shard_crc32(path))
    mf.write_manifest(str(root), mf.Manifest(step=step, world_size=len(states), tier="L2", shards=shards))
    mf.set_latest(str(root), step)


def test_export_dcp_and_torch_read_back(tmp_path, capsys):
    states, model, mom, *_ = _rank_states()
    for s in states:
        s["extras"] = {"epoch": 2}
    _write_tier(tmp_path / "ck", states)
    assert [len(s["objects"]["optim"]["shards"]["momentum"]) for s in read_rank_states(str(tmp_path / "ck"), 20)] \
        == [4, 4, 3]
    out = tmp_path / "out"
    assert main(["ckpt", "export", str(tmp_path / "ck"), "--format", "dcp", str(out)]) == 0
    assert "exported step 20" in capsys.readouterr().out
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    fresh = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(4)},
             "optim": {"shards": {"momentum": torch.zeros(11)}, "lr": 0.0}, "step": 0, "position": 0}
    dcp.load(fresh, checkpoint_id=str(out), no_dist=True)
    assert torch.equal(fresh["model"]["w"], model["w"]) and torch.equal(fresh["optim"]["shards"]["momentum"], mom)
    assert (fresh["step"], fresh["position"], fresh["optim"]["lr"]) == (20, 99, 0.1)
    pt = tmp_path / "all.pt"
    assert main(["ckpt", "export", str(tmp_path / "ck"), "--step", "20", "--format", "torch", str(pt)]) == 0
    assert stat.S_IMODE(pt.stat().st_mode) == 0o600
    got = torch.load(pt, weights_only=True)
    assert torch.equal(got["optim"]["shards"]["momentum"], mom) and got["extras"] == {"epoch": 2}


def test_export_bad_input_one_line(tmp_path, capsys):
    states, *_ = _rank_states(world=2)
    _write_tier(tmp_path / "ck", states)
    (tmp_path / "exists").mkdir()
    (tmp_path / "empty").mkdir()
    local = tmp_path / "local"  # a node-local root: its manifest lists rank 0 only
    _write_tier(local, states[:1])
    os.unlink(mf.manifest_path(str(local), 20))
    mf.write_manifest(str(local), mf.Manifest(step=20, world_size=2, tier="L1",
                                              shards={0: mf.read_manifest(str(tmp_path / "ck"), 20).shards[0]}),
                      require_shards=False)
    cases = [
        (["--step", "7", str(tmp_path / "ck"), str(tmp_path / "o1")], "step 7 is not a complete checkpoint"),
        ([str(tmp_path / "ck"), str(tmp_path / "exists")], "exists: the export never replaces"),
        ([str(tmp_path / "empty"), str(tmp_path / "o2")], "no complete checkpoint under"),
        ([str(tmp_path / "nodir"), str(tmp_path / "o3")], "no such directory"),
        ([str(tmp_path / "ck"), str(tmp_path / "no" / "o4")], "no such directory"),
        ([str(local), str(tmp_path / "o5")], "lacks the shards of ranks [1]"),
    ]
    for args, msg in cases:
        assert main(["ckpt", "export", *args]) == 2, args
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "empty", "exists", "local"]


def test_initial_state_loads_replicated_and_this_ranks_slice(tmp_path):
    states, model, mom, *_ = _rank_states()
    states[0]["objects"]["optim"]["state"] = {0: {"buf": torch.ones(2)}}
    states[0]["objects"]["optim"]["param_groups"] = [{"params": [0], "lr": 0.1}]
    write_dcp(global_state(states), str(tmp_path / "d"))
    for world in (1, 2):
        for rank in range(world):
            a, b = slice_range({"split": "even"}, 11, world, rank)
            current = {"objects": {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(4)},
                                   "optim": {"shards": {"momentum": torch.zeros(b - a)}}},
                       "step": 0, "position": 0, "rng": {"torch": "kept"}, "extras": {}}
            st = initial_state(str(tmp_path / "d"), current, ["optim"], world, rank)
            assert torch.equal(st["objects"]["model"]["w"], model["w"]) and st["rng"] == {"torch": "kept"}
            assert torch.equal(st["objects"]["optim"]["shards"]["momentum"], mom[a:b])
            assert list(st["objects"]["optim"]["state"]) == [0]  # DCP's "0" is an int id again
            assert (st["step"], st["position"]) == (20, 99)
    assert set(read_dcp(str(tmp_path / "d"), ["model", "zzz"])) == {"model"}


def test_init_from_bad_input(tmp_path):
    write_dcp({"model": {"w": torch.zeros(2)}}, str(tmp_path / "d"))
    with pytest.raises(CheckpointError, match=r"lacks optim \(it has model\)"):
        check_init_from(str(tmp_path / "d"), ["model", "optim"])
    with pytest.raises(CheckpointError, match="is not a DCP checkpoint"):
        check_init_from(str(tmp_path), ["model"])
    with pytest.raises(ConfigError, match="must be an absolute path"):
        load_config({"checkpoint": {"init_from": "rel/dcp"}})
    assert load_config({"checkpoint": {"init_from": str(tmp_path / "d")}}).checkpoint.init_from == str(tmp_path / "d")


def test_cli_refuses_an_init_from_that_is_not_a_dcp_checkpoint(tmp_path, capsys):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"checkpoint: {{init_from: {tmp_path}}}\n")
    assert main(["local", "--config", str(cfg), "--", "python", "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a DCP checkpoint (no .metadata file)" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]
