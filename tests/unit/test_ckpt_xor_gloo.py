"""XOR tier through the engine with real gloo transfer groups, one thread per rank.

Quicker than the process-per-rank tests in ``tests/local/test_ckpt_xor.py``: the
ranks are threads of this process, each with its own engine, per-node directory
and gloo group (the real :class:`Generation`), so collectives, files and checksums
are all real. Covers the encode rounds, a lost node, a failing rank's vote, a
rank that never joins the rebuild, and PARTNER copies over the same groups.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slurm_resilience.checkpoint import layout
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint import xor_rebuild, xor_tier
from slurm_resilience.checkpoint.engine import CheckpointEngine
from slurm_resilience.checkpoint.tiers import Redundancy, TierSpec
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.worker.reconnect import Generation

pytestmark = pytest.mark.timeout(120)


def _state(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.rand(2000 + 700 * rank, generator=g), "h": torch.rand(5, generator=g).half(), "step": step}


class Cluster:
    """N rank threads sharing one TCPStore; ``run`` calls fn(rank, engine) on all of them."""

    def __init__(self, root, nodes, *, gen, group_size=3, timeout_s=20.0, redundancy=Redundancy.XOR,
                 interrupted=lambda: False):
        self.root, self.nodes, self.gen, self.interrupted = root, list(nodes), gen, interrupted
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
        self.table = RankTable(generation=gen, slots=tuple(
            RankSlot(rank=i, node=n, worker_id=f"w{i}", local_rank=self.nodes[:i].count(n))
            for i, n in enumerate(self.nodes)))
        spec = TierSpec(name="L1", storage="local", interval_steps=1, redundancy=redundancy,
                        group_size=group_size, path=str(root) + "/{node}/l1", keep=2)
        self.events = [[] for _ in self.nodes]
        self.engines = []
        for r, node in enumerate(self.nodes):
            eng = CheckpointEngine((spec,), job_id="1", run_id="0" * 32, job_dir=str(root), node=node,
                                   emit=lambda kind, _r=r, **f: self.events[_r].append((kind, f)))
            eng.bind(rank=r, world_size=len(self.nodes), nodes=self.nodes, transfer=self._factory(r, timeout_s))
            self.engines.append(eng)

    def _factory(self, rank, timeout_s):
        def build():  # a store client per rank: one client is not safe to share between threads
            store = dist.TCPStore("127.0.0.1", self.store.port, None, False, timedelta(seconds=30))
            return Generation(store, self.table, rank, backend="gloo", timeout_s=timeout_s,
                              poll_ms=20, interrupted=self.interrupted, channel="ckpt/")
        return build

    def run(self, fn, ranks=None):
        out, errors = {}, []

        def work(r):
            try:
                out[r] = fn(r, self.engines[r])
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(r,)) for r in (ranks or range(len(self.nodes)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        return out

    def close(self):
        for eng in self.engines:
            eng.close()


def _save(steps):
    def fn(rank, eng):
        for s in steps:
            eng.save(s, _state(rank, s))
            assert eng.wait(60)
        return eng.failures
    return fn


@pytest.fixture
def small_rounds(monkeypatch):
    monkeypatch.setattr(xor_tier, "ROUND_BYTES", 1024)
    monkeypatch.setattr(xor_rebuild, "ROUND_BYTES", 1024)


def test_encode_then_rebuild_a_lost_node(tmp_path, small_rounds):
    nodes = ["a", "b", "c", "d"]  # group_size 3 with 4 ranks: one group of 4 (a remainder of 1 merges)
    c = Cluster(tmp_path, nodes, gen=0)
    try:
        assert c.run(_save([1, 2])) == {r: [] for r in range(4)}
    finally:
        c.close()
    for r, node in enumerate(nodes):
        l1 = str(tmp_path / node / "l1")
        man = mf.read_manifest(l1, 2)
        assert man.extra["xor"][str(r)]["parity"] == f"xor-{r:05d}.bin"
        hdr, _, row = xor_tier.read_parity(layout.parity_path(l1, 2, r))
        assert hdr.group == (0, 1, 2, 3) and hdr.member == r and hdr.step == 2
        assert len(row) * 3 >= max(hdr.lengths)  # a row is about a third of a shard
    lost = (tmp_path / "c" / "l1" / "step-00000002" / "rank-00002.h5").read_bytes()
    shutil.rmtree(tmp_path / "c")

    c = Cluster(tmp_path, nodes, gen=1)
    try:
        rebuilt = c.run(lambda r, eng: eng.rebuild_missing())
        best = c.run(lambda r, eng: eng.best())
        state = c.engines[2].load(best[2])
    finally:
        c.close()
    assert all(v == [(2, 2, True)] for v in rebuilt.values()), rebuilt
    assert best[2] == (2, "L1", mf.shard_path(str(tmp_path / "c" / "l1"), 2, 2))
    assert (tmp_path / "c" / "l1" / "step-00000002" / "rank-00002.h5").read_bytes() == lost
    for name in ("rank-00002.h5", "xor-00002.bin", "manifest.json"):  # private, like every file we write
        assert os.stat(tmp_path / "c" / "l1" / "step-00000002" / name).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "c" / "l1" / "step-00000002").st_mode & 0o777 == 0o700
    want = _state(2, 2)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["h"], want["h"]) and state["h"].dtype == torch.half


def test_nothing_lost_is_a_cheap_no_op(tmp_path):
    nodes = ["a", "b", "c"]
    c = Cluster(tmp_path, nodes, gen=0)
    try:
        c.run(_save([1]))
        assert c.run(lambda r, eng: eng.rebuild_missing()) == {r: [] for r in range(3)}
    finally:
        c.close()
    plans = [f["plan"] for k, f in c.events[0] if k == "checkpoint_rebuilt"]
    assert plans == ["step 1: nothing lost"]


def test_failed_shard_fails_every_vote(tmp_path):
    nodes = ["a", "b", "c"]
    c = Cluster(tmp_path, nodes, gen=0)
    try:
        c.run(_save([1]))
        (tmp_path / "b" / "l1" / "step-00000002").mkdir(mode=0o700)
        (tmp_path / "b" / "l1" / "step-00000002" / "rank-00001.h5").mkdir()  # rank 1 cannot write its shard
        failures = c.run(_save([2]))
    finally:
        c.close()
    assert all([s for s, _ in f] == [2] for f in failures.values()), failures
    assert "ranks [1] failed" in failures[0][0][1]
    for node in nodes:
        l1 = str(tmp_path / node / "l1")
        assert mf.complete_steps(l1) == [1] and mf.read_latest(l1) == 1


def test_a_rank_that_never_joins_fails_the_rebuild_not_the_caller(tmp_path):
    nodes = ["a", "b", "c"]
    c = Cluster(tmp_path, nodes, gen=0)
    try:
        c.run(_save([1]))
    finally:
        c.close()
    shutil.rmtree(tmp_path / "a")
    c = Cluster(tmp_path, nodes, gen=1, timeout_s=3.0)
    try:
        out = c.run(lambda r, eng: eng.rebuild_missing(), ranks=[0, 1])  # rank 2 never calls it
    finally:
        c.close()
    assert out == {0: [], 1: []}
    for r in (0, 1):
        assert [k for k, _ in c.events[r]] == ["checkpoint_rebuild_failed"], c.events[r]
    assert not os.path.exists(mf.shard_path(str(tmp_path / "a" / "l1"), 1, 0))


def test_partner_copies_over_the_same_groups(tmp_path):
    """PARTNER (the other node-local redundancy) through the same harness: each node holds
    its partner source's shard, bit-identical, under a committed partner manifest."""
    nodes = ["a", "b", "c"]
    c = Cluster(tmp_path, nodes, gen=0, redundancy=Redundancy.PARTNER)
    try:
        assert c.run(_save([1, 2])) == {r: [] for r in range(3)}
    finally:
        c.close()
    for r, node in enumerate(nodes):
        src = (r - 1) % 3  # partner_of(src) == r with one rank per node
        proot = str(tmp_path / node / "l1" / "partner")
        assert mf.complete_steps(proot) == [1, 2]
        copy = mf.shard_path(proot, 2, src)
        own = mf.shard_path(str(tmp_path / nodes[src] / "l1"), 2, src)
        assert open(copy, "rb").read() == open(own, "rb").read()
        assert mf.validate_step(proot, 2, deep=True) == []


def test_a_copy_exchange_cut_off_by_a_lost_node_does_not_hold_the_next_generation(tmp_path):
    """Node c is cut off mid-exchange (its process lives, it just never answers): a and b
    abandon step 2's partner exchange when the next plan is out, then checkpoint step 3
    in a generation of their own. Gloo runs the abandoned exchange on until the old
    group's timeout; the old group is parked (``bind(park=)``), so its destructor, which
    waits for that, never runs in the writer or in whichever thread the garbage collector
    happens to free it from; step 3 is committed long before the timeout."""
    nodes, timeout_s, cut = ["a", "b", "c"], 8.0, threading.Event()
    old = Cluster(tmp_path, nodes, gen=0, timeout_s=timeout_s, redundancy=Redundancy.PARTNER,
                  interrupted=cut.is_set)
    parked = []
    try:
        assert old.run(_save([1])) == {r: [] for r in range(3)}  # the group is up on every rank

        def cut_off(rank, eng):  # c never joins step 2's exchange; the plan is out 0.5 s later
            eng.save(2, _state(rank, 2))
            threading.Timer(0.5, cut.set).start()
            assert eng.wait(60)
            return [s for s, _ in eng.failures]
        assert old.run(cut_off, ranks=[0, 1]) == {0: [2], 1: [2]}
        new_table = RankTable(generation=1, slots=tuple(
            RankSlot(rank=i, node=n, worker_id=f"w{i}", local_rank=0) for i, n in enumerate(nodes[:2])))

        def next_generation(rank, eng):
            def build():
                store = dist.TCPStore("127.0.0.1", old.store.port, None, False, timedelta(seconds=30))
                return Generation(store, new_table, rank, backend="gloo", timeout_s=timeout_s, poll_ms=20,
                                  interrupted=lambda: False, channel="ckpt/")
            t0 = time.monotonic()
            eng.bind(rank=rank, world_size=2, nodes=nodes[:2], transfer=build, park=parked.append)
            eng.save(3, _state(rank, 3))
            assert eng.wait(60)
            gc.collect()  # the collector runs in whatever thread allocates: here, on the critical path
            return time.monotonic() - t0, [s for s, _ in eng.failures]
        took = old.run(next_generation, ranks=[0, 1])
    finally:
        cut.set()
        old.close()
    for rank in (0, 1):
        elapsed, failed = took[rank]
        assert failed == [2], failed  # step 3 committed in the new generation
        assert elapsed < timeout_s / 2, f"rank {rank}: step 3 took {elapsed:.1f} s (held by the old group)"
    # each rank's old transfer group (built, its exchange abandoned) is parked: the parking
    # lot drops it after the group timeout, so no thread on a recovery's path destroys it
    assert len(parked) == 2 and all(p.get().generation == 0 for p in parked), parked
    assert mf.complete_steps(str(tmp_path / "a" / "l1" / "partner")) == [1, 3]


# -- several ranks per node (G = 2): one node-local directory per node --------------

G2 = ["a", "a", "b", "b", "c", "c"]


def test_g2_xor_node_of_two_ranks_is_rebuilt(tmp_path):
    """Ranks 2k and 2k+1 share node k's directory: its manifest lists both, retention
    (keep=2 over 5 steps) never fails a checkpoint, and losing node b rebuilds both of
    its ranks from parity onto the replacement node d, bit-identical."""
    c = Cluster(tmp_path, G2, gen=0, group_size=3)
    try:
        assert c.run(_save([1, 2, 3, 4, 5])) == {r: [] for r in range(6)}
    finally:
        c.close()
    for k, node in enumerate("abc"):
        l1 = str(tmp_path / node / "l1")
        assert mf.complete_steps(l1) == [4, 5] and mf.read_latest(l1) == 5
        assert sorted(mf.read_manifest(l1, 5).shards) == [2 * k, 2 * k + 1]
        assert mf.validate_step(l1, 5, deep=True) == []
        assert sorted(os.listdir(l1)) == ["latest", "step-00000004", "step-00000005"]
    lost = {r: (tmp_path / "b" / "l1" / "step-00000005" / f"rank-{r:05d}.h5").read_bytes() for r in (2, 3)}
    shutil.rmtree(tmp_path / "b")

    c = Cluster(tmp_path, ["a", "a", "d", "d", "c", "c"], gen=1, group_size=3)
    try:
        rebuilt = c.run(lambda r, eng: eng.rebuild_missing())
        best = c.run(lambda r, eng: eng.best())
    finally:
        c.close()
    assert all(v == [(5, 2, True), (5, 3, True)] for v in rebuilt.values()), rebuilt
    d = str(tmp_path / "d" / "l1")
    assert sorted(mf.read_manifest(d, 5).shards) == [2, 3] and mf.read_latest(d) == 5
    for r in (2, 3):
        assert best[r] == (5, "L1", mf.shard_path(d, 5, r))
        assert open(mf.shard_path(d, 5, r), "rb").read() == lost[r]
    events = [f for r in range(6) for k, f in c.events[r] if k == "checkpoint_rebuilt"]
    assert len(events) == 6 and {f["plan"] for f in events} == {"step 5: rebuild ranks [2, 3]"}
    assert sorted(r for f in events for r in f["ranks"]) == [2, 3]  # named once in the job's log


def test_g2_partner_copies_are_on_the_next_node(tmp_path):
    """Same local rank on the next node: node b holds the copies of a's ranks, and so on;
    after losing node b every shard is still on disk somewhere, bit-identical."""
    c = Cluster(tmp_path, G2, gen=0, redundancy=Redundancy.PARTNER)
    try:
        assert c.run(_save([1, 2, 3])) == {r: [] for r in range(6)}
    finally:
        c.close()
    for k, node in enumerate("abc"):
        prev = "abc"[(k - 1) % 3]
        proot = str(tmp_path / node / "l1" / "partner")
        assert mf.complete_steps(proot) == [2, 3]
        assert sorted(mf.read_manifest(proot, 3).shards) == [2 * ((k - 1) % 3), 2 * ((k - 1) % 3) + 1]
        assert mf.validate_step(proot, 3, deep=True) == []
        for r in mf.read_manifest(proot, 3).shards:
            own = mf.shard_path(str(tmp_path / prev / "l1"), 3, r)
            assert open(mf.shard_path(proot, 3, r), "rb").read() == open(own, "rb").read()
    shutil.rmtree(tmp_path / "b")
    left = {r for node in "ac" for root in (tmp_path / node / "l1", tmp_path / node / "l1" / "partner")
            for r in mf.read_manifest(str(root), 3).shards}
    assert left == set(range(6))


def test_prune_leaves_a_step_a_node_mate_already_removed(tmp_path, monkeypatch):
    """Retention is the root owner's; still, a step (or one of its files) that vanished
    between the scan and the delete is deleted, not a failed checkpoint."""
    root = str(tmp_path / "l1")
    for step in (1, 2, 3):
        path = mf.shard_path(root, step, 0)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").write(b"x")
        mf.write_manifest(root, mf.Manifest(step=step, world_size=1, tier="L1",
                                            shards={0: mf.ShardRecord("rank-00000.h5", 1, 0)}))
    mf.set_latest(root, 3)
    real = mf.steps_to_prune

    def racing(*a, **kw):  # another process removes step 1 completely and step 2's shard
        doomed = real(*a, **kw)
        shutil.rmtree(mf.step_dir(root, 1))
        os.unlink(mf.shard_path(root, 2, 0))
        return doomed

    monkeypatch.setattr(mf, "steps_to_prune", racing)
    assert mf.prune(root, keep_last=1) == [1, 2]
    assert mf.complete_steps(root) == [3] and not os.path.exists(mf.step_dir(root, 2))
