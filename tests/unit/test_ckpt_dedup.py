"""Deduplicated shared-tier (L2) checkpoints: the owner plan and the one reader.

Four ranks as threads of this process, each with its own engine and a real gloo
transfer group (``Generation``), writing to a real shared directory: every
replicated tensor is written exactly once, each rank restores exactly what it
saved, and a lost or corrupt owner's file makes that step unusable (an older one
is restored, one ``checkpoint_invalid`` event).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slurm_resilience.checkpoint import dedup, layout
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.engine import CheckpointEngine
from slurm_resilience.checkpoint.hdf5_format import flatten_state, shard_contents
from slurm_resilience.checkpoint.shared_read import read_rank_state, verify_rank_problems
from slurm_resilience.checkpoint.tiers import TierSpec
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.protocol import StoreKey
from slurm_resilience.worker.reconnect import Generation
from slurm_resilience.worker.reshard import restore_sharded, shard_range

pytestmark = pytest.mark.timeout(120)
WORLD = 4


def rank_state(rank, step):
    """A replicated model + optimizer, a per-rank RNG, a sharded object's slice of rank."""
    g = torch.Generator().manual_seed(step)
    model = {"w": torch.rand(300, 7, generator=g), "b": torch.rand(7, generator=g), "h": torch.rand(33, generator=g).half()}
    opt = {"state": {"0": {"exp_avg": torch.rand(300, 7, generator=g), "step": torch.tensor(float(step))}}}
    a, b = shard_range(26, WORLD, rank)  # the sharded convention: slices of arange(26), zeros(24)
    zero = {"shards": {"m": torch.arange(a, b, dtype=torch.float64), "z": torch.zeros(6)}, "lr": 0.1}
    return {"step": step, "objects": {"model": model, "optimizer": opt, "zero": zero},
            "rng": {"torch": torch.Generator().manual_seed(1000 * rank + step).get_state()},
            "shard_totals": {"zero": {"m": 26, "z": 6 * WORLD}}}


class Cluster:
    def __init__(self, root, *, dedup_shared=True):
        nodes = [f"n{i}" for i in range(WORLD)]
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
        self.table = RankTable(generation=0, slots=tuple(
            RankSlot(rank=i, node=n, worker_id=f"w{i}", local_rank=0) for i, n in enumerate(nodes)))
        spec = TierSpec(name="L2", storage="shared", interval_steps=1, path=str(root / "l2"), keep=3)
        self.l2, self.spec, self.root, self.nodes = str(root / "l2"), spec, root, nodes
        self.events = [[] for _ in nodes]
        self.engines = []
        for r, node in enumerate(nodes):
            eng = CheckpointEngine((spec,), job_id="1", run_id="0" * 32, job_dir=str(root), node=node,
                                   emit=lambda kind, _r=r, **f: self.events[_r].append((kind, f)))
            eng.dedup_shared = dedup_shared
            eng.bind(rank=r, world_size=WORLD, nodes=nodes, transfer=self._factory(r))
            self.engines.append(eng)

    def _factory(self, rank):
        def build():
            store = dist.TCPStore("127.0.0.1", self.store.port, None, False, timedelta(seconds=30))
            return Generation(store, self.table, rank, backend="gloo", timeout_s=20,
                              poll_ms=20, interrupted=lambda: False, channel="ckpt/")
        return build

    def save(self, steps):
        errors = []

        def work(r):
            try:
                for s in steps:
                    self.engines[r].save(s, rank_state(r, s))
                    assert self.engines[r].wait(60)
                assert self.engines[r].failures == []
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors

    def fresh(self, rank, events):
        """A relaunched rank's engine: nothing in memory, the shared tier only."""
        eng = CheckpointEngine((self.spec,), job_id="1", run_id="0" * 32, job_dir=str(self.root),
                               node=self.nodes[rank],
                               emit=lambda kind, **f: events.append((kind, f)))
        eng.bind(rank=rank, world_size=WORLD, nodes=self.nodes, transfer=None)
        self.engines.append(eng)
        return eng

    def close(self):
        for eng in self.engines:
            eng.close()


def assert_equal(a, b):
    fa, sa = flatten_state(a)
    fb, sb = flatten_state(b)
    assert sa == sb and fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]), k


def test_plan_owners_is_balanced_and_deterministic():
    sizes = {f"t{i}": n for i, n in enumerate([100, 90, 80, 10, 10, 5, 0])}
    a = dedup.plan_owners(sizes, 3)
    assert a == dedup.plan_owners(dict(reversed(list(sizes.items()))), 3)  # insertion order is irrelevant
    assert set(a) == set(sizes) and set(a.values()) <= {0, 1, 2}
    loads = [sum(n for k, n in sizes.items() if a[k] == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert dedup.plan_owners({}, 2) == {} and dedup.plan_owners({"x": 5}, 1) == {"x": 0}
    with pytest.raises(ValueError):
        dedup.plan_owners({"x": 1}, 0)


def test_replicated_excludes_differing_and_sharded_keys():
    keys = ["objects/a", "objects/b", "objects/objects/zero/shards/m"]
    rows = [[1, 2, 3], [1, 9, 3]]
    assert dedup.replicated(keys, rows, dedup.sharded_prefixes({"shard_totals": {"zero": {}}})) == ["objects/a"]


def test_dedup_step_writes_each_tensor_once_and_restores_every_rank(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.save([1, 2])
        man = mf.read_manifest(c.l2, 2)
        owners = dedup.owners_of(man.extra)
        files = {r: layout.shard_path(c.l2, 2, r) for r in range(WORLD)}
        held = {r: shard_contents(p)[0] for r, p in files.items()}
        want, _ = flatten_state(rank_state(0, 2))
        replicated = {k for k in want if k.startswith(("objects/objects/model", "objects/objects/optimizer"))}
        assert set(owners) == replicated  # per-rank RNG and sharded slices are not deduplicated
        assert len({owners[k] for k in owners}) > 1  # spread over ranks, not all on one
        for k in replicated:  # written exactly once, by its owner
            assert [r for r in range(WORLD) if k in held[r]] == [owners[k]], k
        for r in range(WORLD):  # the rest: every rank's own copy
            assert held[r] - replicated == set(want) - replicated
        assert mf.validate_step(c.l2, 2, deep=True) == []
        for r in range(WORLD):
            eng = c.fresh(r, [])
            best = eng.best()
            assert best[:2] == (2, "L2")
            assert_equal(eng.load(best), rank_state(r, 2))
            assert_equal(read_rank_state(files[r]), rank_state(r, 2))
        # a rank file without its owners' files is not the whole state
        os.rename(files[3], files[3] + ".away")
        assert verify_rank_problems(files[0])
        assert mf.validate_step(c.l2, 2, deep=True)
        events = []
        eng = c.fresh(0, events)
        best = eng.best()
        assert best[:2] == (1, "L2")  # the older step
        assert_equal(eng.load(best), rank_state(0, 1))
        assert [f["step"] for k, f in events if k == "checkpoint_invalid"] == [2]
    finally:
        c.close()


def test_corrupt_owner_file_falls_back_to_older_step(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.save([1, 2])
        owners = dedup.owners_of(mf.read_manifest(c.l2, 2).extra)
        key = max(owners, key=lambda k: "exp_avg" in k)
        path = layout.shard_path(c.l2, 2, owners[key])
        with open(path, "r+b") as f:  # flip the last byte of the owned tensor's data
            import h5py
            with h5py.File(path, "r", locking=False) as h:
                off = h[key].id.get_offset() + h[key].id.get_storage_size() - 1
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        reader = (owners[key] + 1) % WORLD  # a rank that reads it from the owner's file
        events = []
        eng = c.fresh(reader, events)
        best = eng.best()
        assert best[:2] == (1, "L2")
        assert_equal(eng.load(best), rank_state(reader, 1))
        invalid = [f for k, f in events if k == "checkpoint_invalid"]
        assert len(invalid) == 1 and invalid[0]["step"] == 2
    finally:
        c.close()


def test_full_shards_when_dedup_is_off(tmp_path):
    c = Cluster(tmp_path, dedup_shared=False)
    try:
        c.save([1])
        assert mf.read_manifest(c.l2, 1).extra == {}
        want, _ = flatten_state(rank_state(0, 1))
        assert shard_contents(layout.shard_path(c.l2, 1, 2))[0] == set(want)
        eng = c.fresh(2, [])
        assert_equal(eng.load(eng.best()), rank_state(2, 1))
    finally:
        c.close()


def test_dedup_file_under_a_manifest_without_the_record_is_invalid(tmp_path):
    """A headless commit (full-shard manifest) over a dedup step's files: not restorable."""
    c = Cluster(tmp_path)
    try:
        c.save([1, 2])
        man = mf.read_manifest(c.l2, 2)
        mf.write_manifest(c.l2, mf.Manifest(step=2, world_size=WORLD, tier="L2", shards=man.shards, extra={},
                                                run_id=man.run_id, job_id=man.job_id))
        path = layout.shard_path(c.l2, 2, 0)
        assert "held by no file" in verify_rank_problems(path)[0]
        assert mf.validate_step(c.l2, 2, deep=True)
        events = []
        best = c.fresh(0, events).best()
        assert best[:2] == (1, "L2") and [k for k, _ in events] == ["checkpoint_invalid"]
    finally:
        c.close()


class _Gen:
    def __init__(self, rank, world):
        self.generation, self.rank, self.world_size = 7, rank, world

    def interrupted(self):
        return False


class _Store(dict):
    def set(self, key, value):
        self[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return self[key]


def test_resharded_restore_from_a_dedup_step(tmp_path):
    """worker/reshard.py's shared-tier path reads a dedup step through shared_read: a
    2-rank world gets the replicated state and its new slices of the 4 old ones."""
    c = Cluster(tmp_path)
    try:
        c.save([3])
        assert dedup.owners_of(mf.read_manifest(c.l2, 3).extra)
        store = _Store({StoreKey.RESHARD_HELD.of(7, r): b"[]" for r in range(2)})
        for r in range(2):
            state = restore_sharded(_Gen(r, 2), store, c.fresh(r, []), ["zero"])
            a, b = shard_range(26, 2, r)
            assert torch.equal(state["objects"]["zero"]["shards"]["m"], torch.arange(a, b, dtype=torch.float64))
            assert torch.equal(state["objects"]["zero"]["shards"]["z"], torch.zeros(12))
            want = rank_state(0, 3)  # the base: old rank 0's state, replicated tensors from their owners
            assert_equal(state["objects"]["model"], want["objects"]["model"])
            assert_equal(state["objects"]["optimizer"], want["objects"]["optimizer"])
    finally:
        c.close()
