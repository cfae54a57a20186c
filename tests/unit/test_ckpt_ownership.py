"""A checkpoint belongs to one run: another run's steps are not restored, not pruned,
said once; ended runs' directories are removed by the same rule (``clean.py``).

Real files and HDF5 through the engine (world 1); the rules are pure and tested alone.
"""

from __future__ import annotations

import os

import pytest
import torch

from slurm_resilience.checkpoint import clean, layout
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.engine import CheckpointEngine
from slurm_resilience.checkpoint.ownership import Ownership, found_entry
from slurm_resilience.checkpoint.tiers import TierSpec
from slurm_resilience.errors import CheckpointError
from slurm_resilience.run_identity import RunIdentity
from slurm_resilience.worker import headless_io

pytestmark = pytest.mark.timeout(120)

A, B = "a" * 32, "b" * 32
DEFAULT = "/tmp/slurm_resilience-{user}/{job_id}/{run_id}/{node}/ckpt"


class Events(list):
    def __call__(self, kind, **fields):
        self.append((kind, fields))

    def of(self, kind):
        return [f for k, f in self if k == kind]


def tiers(tmp_path, l1=None):
    return (TierSpec(name="L1", storage="local", interval_steps=1, path=l1 or str(tmp_path / "l1" / "{node}"), keep=3),
            TierSpec(name="L2", storage="shared", every_kth=2, path=str(tmp_path / "l2"), keep=2))


def run_steps(tmp_path, run_id, steps, events=None, **kw):
    eng = CheckpointEngine(tiers(tmp_path, **kw), job_id="1", run_id=run_id, job_dir=str(tmp_path), node="n0",
                           emit=events if events is not None else Events())
    try:
        for s in steps:
            eng.save(s, {"objects": {"model": {"w": torch.full((4,), float(s))}}, "step": s})
            assert eng.wait(30)
    finally:
        eng.close()


def engine(tmp_path, run_id, events, **kw):
    return CheckpointEngine(tiers(tmp_path), job_id="1", run_id=run_id, job_dir=str(tmp_path), node="n0",
                            emit=events, **kw)


def test_a_new_run_where_another_left_checkpoints_starts_from_scratch_and_says_so_once(tmp_path):
    run_steps(tmp_path, A, [10, 11, 12, 13])
    events = Events()
    eng = engine(tmp_path, B, events)
    try:
        assert eng.candidates() == [] and eng.best() is None  # nothing of this run's: step 0
        assert eng.best() is None
        (foreign,) = events.of("checkpoint_foreign")  # one event for both tiers, and not again
        assert foreign["run_id"] == B
        assert {(e["tier"], tuple(e["steps"]), tuple(e["run_ids"])) for e in foreign["found"]} == {
            ("L1", (13, 12, 11), (A,)), ("L2", (12, 10), (A,))}
        assert "ignored" in foreign["note"]
    finally:
        eng.close()


def test_the_new_run_restores_its_own_steps_and_prunes_only_its_own(tmp_path):
    run_steps(tmp_path, A, [10, 11, 12, 13])
    run_steps(tmp_path, B, [1, 2, 3, 4, 5])
    l1 = str(tmp_path / "l1" / "n0")
    assert mf.complete_steps(l1) == [3, 4, 5, 11, 12, 13]  # B kept its 3 newest; A's not counted, not deleted
    assert mf.complete_steps(str(tmp_path / "l2")) == [2, 4, 10, 12]
    events = Events()
    eng = engine(tmp_path, B, events)
    try:
        step, source, _ = eng.best()
        assert (step, source) == (5, "L1")  # B's newest, not A's step 13
        assert torch.equal(eng.load(eng.best())["objects"]["model"]["w"], torch.full((4,), 5.0))
    finally:
        eng.close()
    again = Events()
    eng = engine(tmp_path, A, again)  # and A (say, requeued) still finds its own
    try:
        assert eng.best()[:2] == (13, "L1")
        assert {e["steps"][0] for e in again.of("checkpoint_foreign")[0]["found"]} == {5, 4}
    finally:
        eng.close()


def test_a_manifest_without_a_run_id_is_foreign_unless_adopted(tmp_path):
    run_steps(tmp_path, A, [1, 2])
    for root in (str(tmp_path / "l1" / "n0"), str(tmp_path / "l2")):
        for step in mf.complete_steps(root):  # as written before run ids
            m = mf.read_manifest(root, step)
            mf.write_manifest(root, mf.Manifest(step=m.step, world_size=m.world_size, tier=m.tier,
                                                shards=m.shards, created=m.created, extra=m.extra))
    events = Events()
    eng = engine(tmp_path, A, events)
    try:
        assert eng.best() is None
        assert "adopt_legacy" in events.of("checkpoint_foreign")[0]["note"]
    finally:
        eng.close()
    eng = engine(tmp_path, A, Events(), adopt_legacy=True)
    try:
        assert eng.best()[:2] == (2, "L1")
    finally:
        eng.close()


def test_the_root_s_speaker_alone_reports():
    events = Events()
    own = Ownership(RunIdentity("1", B), emit=events)
    own._skipped = {("L1", "/x"): {3: A}, ("L2", "/shared"): {4: A}}
    own.report(speaks_for={"/x"})  # not rank 0: the shared root is rank 0's to report
    assert [e["root"] for e in events.of("checkpoint_foreign")[0]["found"]] == ["/x"]
    own.report(speaks_for=set())
    assert len(events) == 1


def test_found_entry_lists_newest_steps_first_and_bounded():
    e = found_entry("L1", "/r", {s: (A if s % 2 else None) for s in range(20)})
    assert e["steps"] == list(range(19, 11, -1)) and e["count"] == 20 and e["run_ids"] == [None, A]


def test_a_headless_persist_never_commits_over_another_run_s_step(tmp_path):
    from slurm_resilience.worker.statesync import TrainingState

    root = str(tmp_path / "l2")
    run_steps(tmp_path, A, [1, 2])  # A's L2 step 2
    spec = TierSpec(name="L2", storage="shared", path=root, interval_steps=10)
    eng = CheckpointEngine([spec], job_id="1", run_id=B, job_dir=str(tmp_path), node="n1")
    try:
        eng.bind(rank=0, world_size=1, nodes=["n1"], transfer=None)
        st = TrainingState()
        st.register(model=torch.nn.Linear(2, 2))
        st.live, st.step, st.position = True, 2, 0
        with pytest.raises(CheckpointError, match="another run's"):
            headless_io.persist(st, eng, rank=0, world_size=1)
        st.step = 3
        headless_io.persist(st, eng, rank=0, world_size=1)
        assert mf.read_manifest(root, 3).run_id == B and eng.best()[0] == 3
    finally:
        eng.close()


# -- cleaning ------------------------------------------------------------------------
VALUES = dict(job_id="1", node="n3", rank=0, job_dir="/j", user="ann")


def test_run_directories_of_the_default_path():
    p = clean.run_dir_pattern(DEFAULT, VALUES)
    assert p.parent == "/tmp/slurm_resilience-ann/1"
    assert clean.stale(p, [A, B, "n3", "x" + A, A.upper()], A) == [f"/tmp/slurm_resilience-ann/1/{B}"]
    joined = clean.run_dir_pattern("/scratch/{user}/{job_id}-{run_id}/{node}", VALUES)
    assert joined.parent == "/scratch/ann" and clean.stale(joined, [f"1-{B}", f"2-{B}", f"1-{A}"], A) == [
        f"/scratch/ann/1-{B}"]  # another job id's run is never this rule's


@pytest.mark.parametrize("template", [
    "/tmp/{user}/{job_id}/{node}/ckpt",  # no run id: nothing to tell runs apart by
    "/tmp/{user}/{run_id}/{job_id}/{node}",  # other runs there may be other live jobs'
    "/tmp/{run_id}/{node}",
    "/tmp/{job_id}/{job_dir}{run_id}",  # a value with '/' in the run's own name
    "/tmp/{job_id}/{run_id}{run_id}",
    "{job_id}{run_id}/x",
    "/tmp/{job_id}/{run_id:.8}/x",
])
def test_no_cleaning_where_the_rule_cannot_tell_an_ended_run(template):
    assert clean.run_dir_pattern(template, VALUES) is None


def test_clean_removes_only_this_user_s_ended_runs_of_this_job_id(tmp_path):
    template = str(tmp_path) + "/{job_id}/{run_id}/{node}/ckpt"
    job = tmp_path / "1"
    for run in (A, B):
        (job / run / "n3" / "ckpt" / "step-00000010").mkdir(parents=True)
    other = "c" * 32
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", job / other)  # a link is not followed, not removed
    (tmp_path / "2" / B).mkdir(parents=True)  # another job id: untouched
    (job / "notes").mkdir()
    events = Events()
    assert clean.clean([("L1", template)], VALUES, A, events) == [str(job / B)]
    assert sorted(os.listdir(job)) == sorted([A, other, "notes"]) and (tmp_path / "2" / B).is_dir()
    (cleaned,) = events.of("checkpoint_cleaned")
    assert cleaned["removed"] == [str(job / B)] and cleaned["failed"] == [] and cleaned["run_id"] == A
    assert clean.clean([("L1", template)], VALUES, A, events) == [] and len(events) == 1  # nothing: no event


def test_the_engine_cleans_at_its_first_generation_from_the_root_s_owner(tmp_path):
    template = str(tmp_path) + "/{job_id}/{run_id}/{node}/ckpt"
    run_steps(tmp_path, B, [1, 2], l1=template)  # B (ended) left its directory
    assert (tmp_path / "1" / B / "n0" / "ckpt").is_dir()
    events = Events()
    eng = CheckpointEngine(tiers(tmp_path, l1=template), job_id="1", run_id=A, job_dir=str(tmp_path), node="n0",
                           emit=events)
    try:
        eng.bind(rank=0, world_size=1, nodes=["n0"], transfer=None)
        eng._cleaner.join(30)
        assert not (tmp_path / "1" / B).exists()
        assert events.of("checkpoint_cleaned")[0]["removed"] == [str(tmp_path / "1" / B)]
        eng.bind(rank=0, world_size=1, nodes=["n0"], transfer=None)  # a later generation: not again
        assert eng._cleaner is not None and not eng._cleaner.is_alive()
    finally:
        eng.close()
    assert layout.expand_path(tiers(tmp_path, l1=template)[0], job_id="1", run_id=A, node="n0") == str(
        tmp_path / "1" / A / "n0" / "ckpt")


def test_the_supervisor_log_says_what_was_ignored_and_removed():
    from slurm_resilience.supervisor.executors.online import checkpoint_notice

    line = checkpoint_notice({"kind": "rank_checkpoint_foreign", "rank": 0, "node": "n2", "found": [
        found_entry("L2", "/j/checkpoints", {20: A, 10: A})]})
    assert line == ("rank 0 on n2: ignored 2 checkpoint step(s) of another run (not restored): "
                    "L2 /j/checkpoints steps [20, 10]")
    line = checkpoint_notice({"kind": "rank_checkpoint_cleaned", "rank": 1, "node": "n3", "removed": ["/t/1/" + B],
                              "failed": []})
    assert line == f"rank 1 on n3: removed 1 checkpoint directory(ies) of ended runs: /t/1/{B}"
    assert checkpoint_notice({"kind": "rank_restored", "rank": 0}) is None
