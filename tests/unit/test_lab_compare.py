"""lab.compare_states / compare_runs: what "bit-identical" means in the e2e tests."""

import json

import torch

from slurm_resilience import lab


def _state(w=1.0, rng_seed=0, objects=None):
    g = torch.Generator().manual_seed(rng_seed)
    return {"step": 40, "position": 40, "extras": {"lr_sum": 1.0},
            "objects": {"model": {"w": torch.full((3,), w)}} if objects is None else objects,
            "rng": {"torch": g.get_state()}}


def _run(tmp_path, name, state, digests):
    d = tmp_path / name
    d.mkdir()
    torch.save(state, d / "final.pt")
    with open(d / "events.jsonl", "w") as f:
        for r, dig in digests.items():
            f.write(json.dumps({"t": 1.0, "kind": "rank_done", "rank": r, "digest": dig}) + "\n")
    return d


def test_identical_runs_have_no_differences(tmp_path):
    a = _run(tmp_path, "a", _state(), {0: "x", 1: "y"})
    b = _run(tmp_path, "b", _state(), {0: "x", 1: "y"})
    assert lab.compare_states(a / "final.pt", b / "final.pt") == []
    assert lab.compare_runs(a / "final.pt", b) == []


def test_weights_rng_and_empty_states_are_differences(tmp_path):
    ref = _run(tmp_path, "ref", _state(), {0: "x"})
    assert lab.compare_states(ref / "final.pt", _run(tmp_path, "w", _state(w=2.0), {0: "x"}) / "final.pt") \
        == ["state.model.w"]
    rng = lab.compare_states(ref / "final.pt", _run(tmp_path, "r", _state(rng_seed=1), {0: "x"}) / "final.pt")
    assert rng == ["rng.torch"]
    e1 = _run(tmp_path, "e1", _state(objects={}), {0: "x"})
    e2 = _run(tmp_path, "e2", _state(objects={}), {0: "x"})
    assert lab.compare_states(e1 / "final.pt", e2 / "final.pt") == ["objects: a state holds no tensor to compare"]


def test_every_rank_is_compared_not_only_rank_0(tmp_path):
    ref = _run(tmp_path, "ref", _state(), {0: "x", 1: "y", 2: "z"})
    other = _run(tmp_path, "o", _state(), {0: "x", 1: "y", 2: "DIFFERENT"})
    assert lab.compare_runs(ref, other) == ["rank 2: final state differs"]
    missing = _run(tmp_path, "m", _state(), {0: "x", 2: "z"})
    diffs = lab.compare_runs(ref, missing)
    assert any("not of every rank" in d for d in diffs) and "rank 1: final state differs" in diffs
    none = _run(tmp_path, "n", _state(), {})
    assert any("not of every rank" in d for d in lab.compare_runs(none, none))
