"""FSDP2 (``session.fsdp``, tests/local/train_fsdp_tiny.py) under the real Supervisor, 3 ranks.

* a node lost and replaced by a spare, and a rank killed while it writes its L1 shard
  (restarted in place; the torn step is never used): every rank ends bit-identical to a
  fault-free run (same world size: same torch.chunk shards, same reduce-scatter order);
* a node lost, no spare: the job scales in to 2 ranks from the newest complete
  checkpoint (resharded 3 → 2) and ends bit-identical to a fresh 2-rank job started
  from that step's checkpoint (the definition of tests/local/test_sharded_state.py).
"""

import shutil
from pathlib import Path

import pytest

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import shard_crc32

from .localjob import LocalJob, assert_bit_identical, final_state, rank_digests

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).with_name("train_fsdp_tiny.py")
STEPS = 16
CKPT = {"local_every": 4, "local_keep": 10, "shared_every_kth": 0}
SLOW_BOX = {"heartbeat_timeout_s": 8, "standby_heartbeat_timeout_s": 16}  # 2-core box: see test_multi_rank


FAULT_STEP_TIME = 0.3  # a node failed at step 6 must find the job still running (~3 s left)


def _job(root, name, step_time=0.05, **kw) -> LocalJob:
    kw.setdefault("checkpoint", CKPT)
    return LocalJob(root, steps=STEPS, step_time=step_time, script=SCRIPT, job_name=name, detect=SLOW_BOX,
                    local_dir=root / f"local-{name}", **kw).start()


def _run(job: LocalJob) -> LocalJob:
    try:
        assert job.wait(200) == 0, job.diag()
    finally:
        job.kill_leftovers()
    return job


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Fault-free, 3 ranks: every rank's final digest and rank 0's final state."""
    ref = _run(_job(tmp_path_factory.mktemp("fsdp-ref"), "ref", nodes=3, spares=0))
    assert not _events(ref, "fault_detected")
    digests = rank_digests(ref)
    assert sorted(digests) == [0, 1, 2]
    return digests, final_state(ref)


def _same_as_reference(job, reference):
    digests, ref = reference
    assert rank_digests(job) == digests, "a rank's final state differs from the fault-free run"
    assert_bit_identical(final_state(job)["objects"], ref["objects"], "objects")


def test_node_replaced_bit_identical_on_every_rank(tmp_path, reference):
    job = _job(tmp_path, "job", nodes=3, spares=1, step_time=FAULT_STEP_TIME)
    st = job.wait_for_step(6)  # past the L1 checkpoint of step 4
    job.launcher.fail_node(st["ranks"][1]["node"])
    _run(job)
    assert [d["level"] for d in _events(job, "recovery_done")] == ["node-replacement"]
    restored = [e for e in _events(job, "rank_restored") if e.get("resharded")]
    assert restored and len({e["step"] for e in restored}) == 1 and restored[0]["step"] >= 4
    _same_as_reference(job, reference)
    ref = reference[1]
    model = ref["objects"]["model"]
    assert model["nested"] and model["layouts"]["0.weight"] == {"shape": [7, 6], "split": "rows"}
    assert ref["shard_layouts"]["optimizer"]["state/5.weight/exp_avg"] == {"shape": [2, 7], "split": "rows"}
    assert int(ref["objects"]["optimizer"]["replicated"]["state"]["0.weight"]["step"]) == STEPS


def test_rank_killed_in_its_l1_flush_recovers_bit_identical(tmp_path, reference):
    """Rank 2 dies with its step-8 shard half written: step 8 never commits; the rank is
    restarted in place and every rank resumes from step 4."""
    job = _run(_job(tmp_path, "flush", nodes=3, spares=0, extra_args=("--die-in-flush", "8:2")))
    assert (job.job_dir / "died-in-flush").exists(), "the rank did not die in its flush"
    assert [d["level"] for d in _events(job, "recovery_done")] == ["online"]
    restored = [e for e in _events(job, "rank_restored") if e.get("resharded")]
    assert len(restored) == 3 and {e["step"] for e in restored} == {4}, restored  # step 8 is torn
    _same_as_reference(job, reference)


def test_scale_in_reshards_like_a_fresh_job_at_the_new_size(tmp_path):
    a = _job(tmp_path, "a", nodes=3, spares=0, step_time=FAULT_STEP_TIME)
    st = a.wait_for_step(6)
    a.launcher.fail_node(st["ranks"][1]["node"])
    _run(a)
    assert [d["level"] for d in _events(a, "recovery_done")] == ["scale-in"]
    resharded = [e for e in _events(a, "rank_restored") if e.get("resharded")]
    assert len(resharded) == 2 and len({e["step"] for e in resharded}) == 1, resharded
    step = resharded[0]["step"]
    assert step >= 4 and step % 4 == 0

    # B: a fresh 2-rank job from A's checkpoint of that step (the three L1 shards, as A's nodes held them)
    dst = tmp_path / "b" / "checkpoints"
    shards = {}
    for r in range(3):
        src = mf.shard_path(str(tmp_path / "local-a" / f"local{r + 1}" / "ckpt"), step, r)
        to = mf.shard_path(str(dst), step, r)
        Path(to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, to)
        shards[r] = mf.ShardRecord(mf.shard_name(r), Path(to).stat().st_size, shard_crc32(to))
    mf.write_manifest(str(dst), mf.Manifest(step=step, world_size=3, tier="L2", shards=shards, created=0.0,
                                            extra={}))
    mf.set_latest(str(dst), step)
    b = _run(_job(tmp_path, "b", nodes=2, spares=0, checkpoint={**CKPT, "shared_every_kth": 1}))
    assert {e["step"] for e in _events(b, "rank_restored") if e.get("resharded")} == {step}
    assert sorted(rank_digests(a)) == [0, 1] and rank_digests(a) == rank_digests(b)
    fa, fb = final_state(a), final_state(b)
    assert fa["step"] == fb["step"] == STEPS
    assert_bit_identical(fa["objects"], fb["objects"], "objects")
    assert fa["objects"]["model"]["shards"]["3.weight"].numel() == 4 * 7  # 7 rows over 2 ranks: 4, 3
