"""Headless ranks (batch host lost): the pure decisions, the guarded store, the commit rule."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from slurm_resilience.checkpoint import layout
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import read_shard, write_shard
from slurm_resilience.config import DetectConfig
from slurm_resilience.errors import ConfigError, JobEnded
from slurm_resilience.worker import headless_io
from slurm_resilience.worker.headless import (
    GuardedStore, HeadlessEnded, StoreWatch, headless_due, manifest_ranks, requeue_turn, should_requeue)


def test_headless_due_only_after_the_timeout_and_never_when_off():
    assert not headless_due(None, 100.0, 5.0)
    assert not headless_due(10.0, 14.9, 5.0)
    assert headless_due(10.0, 15.0, 5.0)
    assert not headless_due(10.0, 1e9, 0.0)


def test_manifest_ranks_replicated_needs_one_sharded_needs_all():
    assert manifest_ranks([2], 4, sharded=False) == {2}
    assert manifest_ranks([], 4, sharded=False) is None
    assert manifest_ranks([0, 1, 2], 4, sharded=True) is None
    assert manifest_ranks([0, 1, 2, 3], 4, sharded=True) == {0, 1, 2, 3}
    assert manifest_ranks([7], 4, sharded=False) is None  # not a rank of this world


def test_requeue_turn_rank0_first_then_staggered_fallbacks():
    assert requeue_turn(0, {0, 1, 2}, 3, 0.0)  # everyone persisted: at once
    assert not requeue_turn(0, {0, 1}, 3, 1.0, settle_s=5.0)
    assert requeue_turn(0, {0, 1}, 3, 5.0, settle_s=5.0)
    assert not requeue_turn(1, {0, 1, 2}, 3, 1.9, stagger_s=2.0)
    assert requeue_turn(1, {0, 1, 2}, 3, 2.0, stagger_s=2.0)
    assert not requeue_turn(2, {0, 1}, 3, 8.9, settle_s=5.0, stagger_s=2.0)
    assert requeue_turn(2, {0, 1}, 3, 9.0, settle_s=5.0, stagger_s=2.0)


def test_should_requeue_only_this_run_once():
    assert should_requeue({"JobState": "RUNNING", "Restarts": "0"}, 0)
    assert not should_requeue({"JobState": "RUNNING", "Restarts": "1"}, 0)  # requeued already
    assert not should_requeue({"JobState": "PENDING", "Restarts": "1"}, 0)
    assert not should_requeue({"JobState": "COMPLETING", "Restarts": "0"}, 0)
    assert not should_requeue({"JobState": "RUNNING", "Restarts": "x"}, 0)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _DeadStore:
    def __init__(self):
        self.calls = 0

    def check(self, keys):
        self.calls += 1
        raise RuntimeError("Connection reset by peer")

    set = add = check


def test_guarded_store_keeps_training_then_raises_after_the_timeout():
    clock, dead = _Clock(), _DeadStore()
    watch = StoreWatch(3.0, clock=clock)
    store, events = GuardedStore(dead, watch), GuardedStore(dead, watch, raises=False)
    assert store.check(["plan/1"]) is False and watch.is_lost
    store.set("done/0", "1")
    assert events.add("ev/count", 1) == 0
    assert dead.calls == 1  # a lost store is not asked again (a silent host would block each call)
    clock.t = 2.9
    assert store.check(["plan/1"]) is False
    clock.t = 3.0
    with pytest.raises(HeadlessEnded) as err:
        store.check(["plan/1"])
    assert isinstance(err.value, JobEnded)
    assert events.check(["x"]) is False  # the event client never raises (other threads use it)


def test_guarded_store_passes_through_while_the_store_answers():
    class Live:
        def check(self, keys):
            return True

        def get(self, key):
            return b"v"

    store = GuardedStore(Live(), StoreWatch(3.0))
    assert store.check(["k"]) is True and store.get("k") == b"v"


def test_headless_timeout_is_validated():
    assert DetectConfig(headless_timeout_s=0).headless_timeout_s == 0
    with pytest.raises(ConfigError, match="headless_timeout_s=1.0 must be > heartbeat_timeout_s=2.0"):
        DetectConfig(headless_timeout_s=1.0)
    with pytest.raises(ConfigError, match="headless_timeout_s"):
        DetectConfig(headless_timeout_s=-5)


def _shard(root, step, rank, value):
    write_shard(layout.shard_path(root, step, rank), {"w": torch.full((3,), float(value))},
                attrs={"step": step, "rank": rank, "world_size": 3})


def test_commit_lists_only_complete_shards_and_never_a_partial_sharded_set(tmp_path):
    root = str(tmp_path / "l2")
    _shard(root, 7, 1, 1.0)
    # a writer killed mid-write leaves only a temporary: never counted
    open(os.path.join(layout.step_dir(root, 7), ".rank-00002.h5.x.tmp"), "wb").write(b"half")
    assert headless_io.commit(root, 7, 3, "L2", sharded=True) is False
    assert not os.path.exists(layout.manifest_path(root, 7))
    assert headless_io.commit(root, 7, 3, "L2", sharded=False) is True
    man = mf.read_manifest(root, 7)
    assert list(man.shards) == [1] and mf.validate_step(root, 7, deep=True) == []
    assert man.extra == {"headless": True}
    _shard(root, 7, 0, 1.0)
    assert headless_io.commit(root, 7, 3, "L2", sharded=False) is False  # committed already: untouched
    assert list(mf.read_manifest(root, 7).shards) == [1]


def test_persist_skips_a_committed_step_and_writes_a_restorable_shard(tmp_path):
    from slurm_resilience.checkpoint.engine import CheckpointEngine
    from slurm_resilience.checkpoint.tiers import TierSpec
    from slurm_resilience.worker.statesync import TrainingState

    spec = TierSpec(name="L2", storage="shared", path=str(tmp_path / "l2"), interval_steps=10)
    eng = CheckpointEngine([spec], job_id="1", run_id="0" * 32, job_dir=str(tmp_path), node="n1")
    try:
        eng.bind(rank=2, world_size=3, nodes=["n1", "n2", "n3"], transfer=None)
        model = torch.nn.Linear(2, 2)
        st = TrainingState()
        st.register(model=model)
        st.live, st.step, st.position = True, 13, 39
        path = headless_io.persist(st, eng, rank=2, world_size=3)
        assert path == layout.shard_path(str(tmp_path / "l2"), 13, 2)
        state, attrs = read_shard(path)
        assert attrs["step"] == 13 and state["step"] == 13 and state["position"] == 39
        assert torch.equal(state["objects"]["model"]["weight"], model.weight.detach())
        assert eng.best()[0] == 13  # what a requeued rank restores
    finally:
        eng.close()


def test_marks_are_per_run(tmp_path):
    headless_io.mark(str(tmp_path), 0, 1)
    headless_io.mark(str(tmp_path), 0, 0)
    headless_io.mark(str(tmp_path), 1, 2, step=17)
    assert (tmp_path / "headless" / "r1-rank2").read_text().split()[1] == "17"  # the step it persisted
    assert headless_io.marked(str(tmp_path), 0) == {0, 1}
    assert headless_io.marked(str(tmp_path), 1) == {2}
    assert headless_io.marked(str(tmp_path / "none"), 0) == set()


def test_batch_host_mark_only_an_unanswering_node_and_as_isolate_state_allows():
    from slurm_resilience.worker.headless import batch_host_mark

    assert batch_host_mark("auto", operator=True, reachable=False) == "DOWN"
    assert batch_host_mark("auto", operator=True, reachable=True) is None  # slurmd answers: not lost
    assert batch_host_mark("auto", operator=False, reachable=False) is None  # no rights: Slurm's timeout
    assert batch_host_mark("none", operator=True, reachable=False) is None
    assert batch_host_mark("DRAIN", operator=True, reachable=False) == "DRAIN"
    assert batch_host_mark("DOWN", operator=False, reachable=False) == "DOWN"


def test_a_broken_connection_to_a_live_store_is_reopened_not_taken_for_a_loss():
    class Live:
        def check(self, keys):
            return True

        def set(self, key, value):
            self.value = value

    clock, opened = _Clock(), []

    def reopen():
        opened.append(Live())
        return opened[-1]

    watch = StoreWatch(3.0, clock=clock)
    store = GuardedStore(_DeadStore(), watch, reopen=reopen)
    assert store.check(["plan/1"]) is True and not watch.is_lost and len(opened) == 1
    store.set("k", "v")
    assert opened[-1].value == "v"


def test_a_store_back_at_the_deadline_clears_the_watch_one_still_gone_ends_the_rank():
    clock, alive = _Clock(), {"up": False}

    class Live:
        def check(self, keys):
            return False

    def reopen():
        if not alive["up"]:
            raise RuntimeError("connect: Connection refused")
        return Live()

    watch = StoreWatch(3.0, clock=clock)
    store = GuardedStore(_DeadStore(), watch, reopen=reopen)
    assert store.check(["plan/1"]) is False and watch.is_lost
    clock.t = 3.0
    alive["up"] = True
    assert store.check(["plan/1"]) is False and not watch.is_lost  # it answers again
    dead = GuardedStore(_DeadStore(), watch, reopen=lambda: (_ for _ in ()).throw(RuntimeError("refused")))
    assert dead.check(["x"]) is False and watch.is_lost
    clock.t = 6.5
    with pytest.raises(HeadlessEnded):
        dead.check(["x"])


def test_requeue_step_requeues_a_running_run_and_only_excludes_one_slurm_requeued():
    from slurm_resilience.worker.headless import RequeueStep, requeue_step

    assert requeue_step({"JobState": "RUNNING", "Restarts": "0"}, 0) is RequeueStep.REQUEUE
    # a het job whose component 0's node was marked DOWN: Slurm requeued it whole itself
    assert requeue_step({"JobState": "PENDING", "Restarts": "1"}, 0) is RequeueStep.EXCLUDE
    assert requeue_step({"JobState": "COMPLETING", "Restarts": "2"}, 1) is RequeueStep.EXCLUDE
    assert requeue_step({"JobState": "RUNNING", "Restarts": "1"}, 0) is RequeueStep.NOTHING  # runs again
    assert requeue_step({"JobState": "PENDING", "Restarts": "2"}, 0) is RequeueStep.NOTHING  # a later run's
    assert requeue_step({"JobState": "CANCELLED", "Restarts": "0"}, 0) is RequeueStep.NOTHING
    assert requeue_step({"JobState": "PENDING", "Restarts": "x"}, 0) is RequeueStep.NOTHING


class _Slurm:
    """``commands`` as the het-job leader answers: requeued by Slurm once its host is DOWN."""

    def __init__(self, states):
        self.states, self.argvs, self.requeued = list(states), [], 0

    def show_job(self, job_id):
        state, restarts = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return {"JobState": state, "Restarts": str(restarts), "BatchHost": "n1", "ExcNodeList": "n9"}

    def requeue_excluding(self, job_id, exclude):
        self.requeued += 1
        return None

    def run(self, argv, timeout=10.0, check=True):
        if argv[:4] == ["scontrol", "-o", "show", "job"]:  # the leader's and component 1's records
            return SimpleNamespace(stdout="JobId=587 HetJobId=587 HetJobOffset=0 ExcNodeList=n9\n"
                                          "JobId=588 HetJobId=587 HetJobOffset=1 ExcNodeList=(null)\n")
        self.argvs.append(list(argv))


def test_requeue_of_a_het_job_slurm_requeued_sets_only_the_exclusion(monkeypatch):
    slurm = _Slurm([("RUNNING", 0), ("PENDING", 1)])  # before the DOWN mark, after it
    for name in ("show_job", "requeue_excluding", "run"):
        monkeypatch.setattr(headless_io.commands, name, getattr(slurm, name))
    monkeypatch.setattr(headless_io, "_mark", lambda *a: ", marked DOWN")
    said = headless_io.requeue("587", 0)
    assert slurm.requeued == 0 and said.startswith("Slurm requeued job 587 itself"), said
    assert slurm.argvs == [["scontrol", "update", "JobId=587+0", "ExcNodeList=n[1,9]"]]  # component 0 alone
    plain = _Slurm([("RUNNING", 0)])  # a single-allocation job runs on: requeued by the rank
    for name in ("show_job", "requeue_excluding", "run"):
        monkeypatch.setattr(headless_io.commands, name, getattr(plain, name))
    assert headless_io.requeue("12", 0).startswith("requeued job 12") and plain.requeued == 1


def test_the_requeue_record_is_not_a_persisted_mark(tmp_path):
    headless_io.mark(str(tmp_path), 0, 0)
    headless_io.record(str(tmp_path), 0, 0, "requeued job 5")
    assert headless_io.marked(str(tmp_path), 0) == {0}
    rec = json.loads((tmp_path / "headless" / "r0-requeue-rank0").read_text())
    assert rec["rank"] == 0 and rec["said"] == "requeued job 5" and rec["t"] > 0


def test_exclusion_targets_component_0_of_a_het_job_and_keeps_its_own_list():
    from slurm_resilience.worker.headless import exclusion

    het = {"70": {"HetJobId": "70", "HetJobOffset": "0", "ExcNodeList": "n[4,6]"},
           "71": {"HetJobId": "70", "HetJobOffset": "1", "ExcNodeList": "(null)"}}
    assert exclusion(het, "70", "n1") == ("70+0", "n[1,4,6]")
    assert exclusion(het, "70", "n4") is None  # listed already
    assert exclusion({"12": {"ExcNodeList": "n2"}}, "12", "n3") == ("12", "n[2-3]")  # a plain job
    assert exclusion({}, "12", "n3") == ("12", "n3")
