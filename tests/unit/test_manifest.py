import itertools
import json
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from slurm_resilience.checkpoint.hdf5_format import write_shard
from slurm_resilience.checkpoint.manifest import (
    Manifest,
    ShardRecord,
    complete_steps,
    incomplete_steps,
    manifest_path,
    prune,
    read_latest,
    read_manifest,
    set_latest,
    shard_name,
    shard_path,
    step_dir,
    steps_to_prune,
    validate_step,
    write_manifest,
)
from slurm_resilience.errors import CheckpointError, ConfigError


def commit(root, step, world_size=2, *, latest=False, extra=None):
    """Write every rank's shard, then the manifest (and optionally latest)."""
    shards = {}
    for rank in range(world_size):
        info = write_shard(shard_path(root, step, rank), {"w": torch.full((8,), float(rank + step))})
        shards[rank] = ShardRecord(shard_name(rank), info.nbytes, info.crc32)
    m = Manifest(step=step, world_size=world_size, tier="L2", shards=shards, created=123.5, extra=extra or {})
    write_manifest(root, m)
    if latest:
        set_latest(root, step)
    return m


def partial(root, step):
    """A step whose writer died: one shard, no manifest."""
    write_shard(shard_path(root, step, 0), {"w": torch.zeros(1)})


# --------------------------------------------------------------------------- layout


def test_paths():
    assert step_dir("/r", 7) == "/r/step-00000007"
    assert shard_path("/r", 7, 3) == "/r/step-00000007/rank-00003.h5"
    assert manifest_path("/r", 123456789) == "/r/step-123456789/manifest.json"


# --------------------------------------------------------------------------- manifest


def test_manifest_json_roundtrip():
    m = Manifest(
        step=5, world_size=2, tier="L1", created=1.25, extra={"generation": 3, "sampler": [1, 2]},
        shards={1: ShardRecord("rank-00001.h5", 10, 2**32 - 1), 0: ShardRecord("rank-00000.h5", 9, 0)},
    )
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert list(back.shards) == [0, 1]


def test_node_local_manifest_lists_only_local_ranks():
    m = Manifest(step=5, world_size=8, tier="L1", created=1.0, shards={3: ShardRecord("rank-00003.h5", 1, 2)})
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("step"),
        lambda d: d.update(format="other"),
        lambda d: d.update(step=-1),
        lambda d: d.update(step="5"),
        lambda d: d.update(step=True),
        lambda d: d.update(world_size=0),
        lambda d: d.update(tier=""),
        lambda d: d["shards"].update({"2": d["shards"]["0"]}),
        lambda d: d.update(shards={}),
        lambda d: d["shards"].update({"x": d["shards"]["0"]}),
        lambda d: d["shards"]["0"].pop("crc32"),
        lambda d: d["shards"]["0"].update(nbytes=-1),
        lambda d: d["shards"]["0"].update(crc32=2**32),
        lambda d: d["shards"]["0"].update(file="../evil.h5"),
        lambda d: d["shards"]["0"].update(file="/abs.h5"),
        lambda d: d.update(extra=[]),
        lambda d: d.update(shards=[]),
        lambda d: d.update(created="now"),
    ],
)
def test_manifest_from_json_rejects_malformed(mutate):
    m = Manifest(step=5, world_size=2, tier="L2", created=1.0,
                 shards={0: ShardRecord("rank-00000.h5", 1, 1), 1: ShardRecord("rank-00001.h5", 1, 1)})
    doc = json.loads(m.to_json())
    mutate(doc)
    with pytest.raises(CheckpointError):
        Manifest.from_json(json.dumps(doc))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '"x"'])
def test_manifest_from_json_rejects_non_objects(text):
    with pytest.raises(CheckpointError):
        Manifest.from_json(text)


def test_manifest_extra_must_be_json():
    m = Manifest(step=1, world_size=1, tier="L2", shards={0: ShardRecord("a.h5", 1, 1)}, extra={"x": object()})
    with pytest.raises(CheckpointError, match="JSON"):
        m.to_json()


def test_write_read_manifest(tmp_path):
    root = str(tmp_path)
    m = commit(root, 100, world_size=3, extra={"data_position": 4096})
    assert read_manifest(root, 100) == m
    assert os.stat(manifest_path(root, 100)).st_mode & 0o777 == 0o600
    assert [n for n in os.listdir(step_dir(root, 100)) if n.startswith(".")] == []


def test_write_manifest_refuses_missing_or_wrong_size_shards(tmp_path):
    root = str(tmp_path)
    info = write_shard(shard_path(root, 1, 0), {"w": torch.ones(2)})
    good = ShardRecord(shard_name(0), info.nbytes, info.crc32)
    missing = Manifest(step=1, world_size=2, tier="L2", shards={0: good, 1: ShardRecord(shard_name(1), 5, 0)})
    with pytest.raises(CheckpointError, match="rank 1 missing"):
        write_manifest(root, missing)
    wrong = Manifest(step=1, world_size=1, tier="L2", shards={0: ShardRecord(shard_name(0), info.nbytes + 1, 0)})
    with pytest.raises(CheckpointError, match="bytes"):
        write_manifest(root, wrong)
    assert not os.path.exists(manifest_path(root, 1))
    write_manifest(root, missing, require_shards=False)  # node-local tiers: shards live elsewhere
    assert complete_steps(root) == [1]


def test_read_manifest_missing_corrupt_and_wrong_step(tmp_path):
    root = str(tmp_path)
    with pytest.raises(CheckpointError, match="missing manifest"):
        read_manifest(root, 1)
    commit(root, 1)
    with open(manifest_path(root, 1), "a") as f:
        f.write("garbage")
    with pytest.raises(CheckpointError, match="corrupt manifest"):
        read_manifest(root, 1)
    commit(root, 2)
    os.makedirs(step_dir(root, 3))
    os.rename(manifest_path(root, 2), manifest_path(root, 3))
    with pytest.raises(CheckpointError, match="records step 2"):
        read_manifest(root, 3)


# --------------------------------------------------------------------------- latest


def test_latest(tmp_path):
    root = str(tmp_path)
    assert read_latest(root) is None
    with pytest.raises(CheckpointError, match="no manifest"):
        set_latest(root, 4)
    partial(root, 4)
    with pytest.raises(CheckpointError, match="no manifest"):
        set_latest(root, 4)  # latest never points at an incomplete step
    commit(root, 4, latest=True)
    assert read_latest(root) == 4
    commit(root, 8, latest=True)
    assert read_latest(root) == 8
    assert os.stat(os.path.join(root, "latest")).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("text", ["", "abc", "-1", "1.5", "\xff"])
def test_read_latest_corrupt(tmp_path, text):
    (tmp_path / "latest").write_text(text, encoding="latin-1")
    with pytest.raises(CheckpointError):
        read_latest(str(tmp_path))


# --------------------------------------------------------------------------- scan


def test_complete_steps_ignores_incomplete_and_foreign(tmp_path):
    root = str(tmp_path)
    assert complete_steps(str(tmp_path / "absent")) == []
    commit(root, 10)
    commit(root, 2)
    partial(root, 30)
    os.makedirs(tmp_path / "step-5")  # not canonical
    os.makedirs(tmp_path / "other")
    (tmp_path / "step-00000040").write_text("a file, not a dir")
    (tmp_path / "latest").write_text("10")
    assert complete_steps(root) == [2, 10]
    assert incomplete_steps(root) == [30]


# --------------------------------------------------------------------------- validate


def test_validate_step_ok(tmp_path):
    root = str(tmp_path)
    commit(root, 3)
    assert validate_step(root, 3) == []
    assert validate_step(root, 3, deep=True) == []


def test_validate_step_problems(tmp_path):
    root = str(tmp_path)
    assert "missing manifest" in validate_step(root, 1)[0]
    commit(root, 1, world_size=3)
    os.unlink(shard_path(root, 1, 2))
    assert any("rank 2 missing" in p for p in validate_step(root, 1))
    commit(root, 2)
    with open(shard_path(root, 2, 1), "ab") as f:
        f.write(b"x")
    assert any("rank 1 is" in p for p in validate_step(root, 2))


def test_validate_step_deep_finds_flipped_byte(tmp_path):
    import h5py

    root = str(tmp_path)
    commit(root, 1)
    path = shard_path(root, 1, 1)
    with h5py.File(path, "r") as f:
        offset = f["objects/w"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 1]))
    assert validate_step(root, 1) == []  # sizes still match
    problems = validate_step(root, 1, deep=True)
    assert len(problems) == 1 and "objects/w checksum mismatch" in problems[0]


def test_validate_step_deep_finds_swapped_shard(tmp_path):
    root = str(tmp_path)
    commit(root, 1)
    # same size, internally valid, but not the shard the manifest committed
    write_shard(shard_path(root, 1, 0), {"w": torch.full((8,), 99.0)})
    assert validate_step(root, 1) == []
    problems = validate_step(root, 1, deep=True)
    assert problems == [f"shard of rank 0 checksum differs from the manifest: {shard_path(root, 1, 0)}"]


# --------------------------------------------------------------------------- prune (pure)


def test_steps_to_prune_examples():
    assert steps_to_prune([1, 2, 3, 4, 5], [], 5, keep_last=2) == [1, 2, 3]
    assert steps_to_prune([10, 20, 30, 40, 50], [], 50, keep_last=1, keep_every=20) == [10, 30]
    assert steps_to_prune([1, 2, 3, 4], [], 2, keep_last=1) == [1, 3]  # latest kept though old
    assert steps_to_prune([1, 2, 3, 4], [], 4, keep_last=1, protect={1}) == [2, 3]
    # incomplete: older than newest complete -> dead; newer -> maybe in progress
    assert steps_to_prune([5, 10], [3, 7, 12], 10, keep_last=5) == [3, 7]
    assert steps_to_prune([], [3, 7], None, keep_last=1) == []
    assert steps_to_prune([1, 2], [], None, keep_last=0) == [1, 2]
    assert steps_to_prune([1, 2], [], 2, keep_last=0) == [1]
    assert steps_to_prune([1, 2], [], None, keep_last=5) == []  # fewer steps than keep_last


@pytest.mark.parametrize("kw", [{"keep_last": -1}, {"keep_last": 1, "keep_every": 0}, {"keep_last": 1.5}])
def test_steps_to_prune_rejects_bad_config(kw):
    with pytest.raises(ConfigError):
        steps_to_prune([1], [], None, **kw)


def _expected(complete, incomplete, latest, keep_last, keep_every, protect):
    """Reference implementation, written independently of the module's."""
    complete = sorted(set(complete))
    newest = complete[-1] if complete else None
    out = []
    for s in sorted(set(complete) | set(incomplete)):
        if s == latest or s in protect:
            continue
        if s in complete:
            rank_from_newest = len(complete) - 1 - complete.index(s)
            if rank_from_newest < keep_last or (keep_every and s % keep_every == 0):
                continue
            out.append(s)
        elif newest is not None and s < newest:
            out.append(s)
    return out


def test_steps_to_prune_exhaustive_small_universe():
    universe = range(5)
    for states in itertools.product((0, 1, 2), repeat=len(universe)):  # absent/complete/incomplete
        complete = [s for s, k in zip(universe, states) if k == 1]
        incomplete = [s for s, k in zip(universe, states) if k == 2]
        for latest in [None, *complete]:
            for keep_last in range(4):
                for keep_every in (None, 1, 2, 3):
                    for protect in ((), (0,), (2, 4)):
                        got = steps_to_prune(complete, incomplete, latest, keep_last, keep_every, protect)
                        assert got == _expected(complete, incomplete, latest, keep_last, keep_every, protect)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.dictionaries(st.integers(0, 10_000), st.booleans(), max_size=30),
    keep_last=st.integers(0, 8),
    keep_every=st.none() | st.integers(1, 50),
    protect=st.frozensets(st.integers(0, 10_000), max_size=5),
    data=st.data(),
)
def test_steps_to_prune_invariants(steps, keep_last, keep_every, protect, data):
    complete = sorted(s for s, done in steps.items() if done)
    incomplete = sorted(s for s, done in steps.items() if not done)
    latest = data.draw(st.none() | st.sampled_from(complete)) if complete else None
    got = steps_to_prune(complete, incomplete, latest, keep_last, keep_every, protect)
    assert got == sorted(set(got))
    assert set(got) <= set(steps)
    assert latest not in got and not set(got) & protect
    assert not set(got) & set(complete[max(0, len(complete) - keep_last):] if keep_last else [])
    if keep_every:
        assert all(s % keep_every for s in got if s in complete)
    if complete:
        assert all(s < complete[-1] for s in got if s in incomplete)
    else:
        assert got == []
    # at least min(keep_last, len(complete)) complete steps survive
    assert len(set(complete) - set(got)) >= min(keep_last, len(complete))
    assert got == _expected(complete, incomplete, latest, keep_last, keep_every, protect)


# --------------------------------------------------------------------------- prune (files)


def test_prune_deletes_on_disk(tmp_path):
    root = str(tmp_path)
    for step in (10, 20, 30, 40, 50):
        commit(root, step)
    set_latest(root, 30)
    partial(root, 25)  # dead write
    partial(root, 60)  # possibly in progress
    deleted = prune(root, keep_last=2, keep_every=20, protect={10})
    assert deleted == [25]
    assert complete_steps(root) == [10, 20, 30, 40, 50]
    deleted = prune(root, keep_last=1)
    assert deleted == [10, 20, 40]
    assert complete_steps(root) == [30, 50]
    assert incomplete_steps(root) == [60]
    assert read_latest(root) == 30
    assert validate_step(root, 30, deep=True) == []


def test_prune_empty_and_bad_latest(tmp_path):
    assert prune(str(tmp_path / "absent"), keep_last=1) == []
    commit(str(tmp_path), 1)
    (tmp_path / "latest").write_text("junk")
    with pytest.raises(CheckpointError):
        prune(str(tmp_path), keep_last=1)
