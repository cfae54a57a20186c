"""FSDP2 (``session.fsdp``, tests/local/train_fsdp_tiny.py) under the real Supervisor, 3 ranks.

* a node lost and replaced by a spare: every rank ends bit-identical to a fault-free run
  (same world size: same torch.chunk shards, same reduce-scatter order);
* a rank killed while it writes its L1 shard, no spare: the torn step is never used, the
  job scales in to 2 ranks from the newest complete checkpoint (resharded 3 → 2) and
  ends bit-identical to a fresh 2-rank job started from that step's checkpoint.
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


def _job(root, name, **kw) -> LocalJob:
    kw.setdefault("checkpoint", CKPT)
    return LocalJob(root, steps=STEPS, step_time=0.05, script=SCRIPT, job_name=name, detect=SLOW_BOX,
                    local_dir=root / f"local-{name}", **kw).start()


def _run(job: LocalJob) -> LocalJob:
    try:
        assert job.wait(200) == 0, job.diag()
    finally:
        job.kill_leftovers()
    return job


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def test_node_replaced_bit_identical_on_every_rank(tmp_path):
    ref = _run(_job(tmp_path, "ref", nodes=3, spares=0))
    assert not _events(ref, "fault_detected")
    job = _job(tmp_path, "job", nodes=3, spares=1)
    st = job.wait_for_step(6)  # past the L1 checkpoint of step 4
    job.launcher.fail_node(st["ranks"][1]["node"])
    _run(job)
    assert [d["level"] for d in _events(job, "recovery_done")] == ["node-replacement"]
    restored = [e for e in _events(job, "rank_restored") if e.get("resharded")]
    assert restored and len({e["step"] for e in restored}) == 1 and restored[0]["step"] >= 4
    digests = rank_digests(ref)
    assert sorted(digests) == [0, 1, 2] and rank_digests(job) == digests, "a rank's final state differs"
    fa, fr = final_state(job), final_state(ref)
    assert_bit_identical(fa["objects"], fr["objects"], "objects")
    model = fr["objects"]["model"]
    assert model["nested"] and model["layouts"]["0.weight"] == {"shape": [7, 6], "split": "rows"}
    assert fr["shard_layouts"]["optimizer"]["state/5.weight/exp_avg"] == {"shape": [2, 7], "split": "rows"}
    assert int(fr["objects"]["optimizer"]["replicated"]["state"]["0.weight"]["step"]) == STEPS


def test_rank_killed_in_l1_flush_scales_in_like_a_fresh_job(tmp_path):
    a = _run(_job(tmp_path, "a", nodes=3, spares=0, extra_args=("--die-in-flush", "8:2")))
    assert (a.job_dir / "died-in-flush").exists(), "the rank did not die in its flush"
    assert [d["level"] for d in _events(a, "recovery_done")] == ["scale-in"]
    resharded = [e for e in _events(a, "rank_restored") if e.get("resharded")]
    assert len(resharded) == 2 and {e["step"] for e in resharded} == {4}, resharded  # step 8 is torn

    # B: a fresh 2-rank job from A's step-4 checkpoint (the three L1 shards, as A's nodes held them)
    dst = tmp_path / "b" / "checkpoints"
    shards = {}
    for r in range(3):
        src = mf.shard_path(str(tmp_path / "local-a" / f"local{r + 1}" / "ckpt"), 4, r)
        to = mf.shard_path(str(dst), 4, r)
        Path(to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, to)
        shards[r] = mf.ShardRecord(mf.shard_name(r), Path(to).stat().st_size, shard_crc32(to))
    mf.write_manifest(str(dst), mf.Manifest(step=4, world_size=3, tier="L2", shards=shards, created=0.0, extra={}))
    mf.set_latest(str(dst), 4)
    b = _run(_job(tmp_path, "b", nodes=2, spares=0, checkpoint={**CKPT, "shared_every_kth": 1}))
    assert {e["step"] for e in _events(b, "rank_restored") if e.get("resharded")} == {4}
    assert sorted(rank_digests(a)) == [0, 1] and rank_digests(a) == rank_digests(b)
    fa, fb = final_state(a), final_state(b)
    assert fa["step"] == fb["step"] == STEPS
    assert_bit_identical(fa["objects"], fb["objects"], "objects")
    assert fa["objects"]["model"]["shards"]["3.weight"].numel() == 4 * 7  # 7 rows over 2 ranks: 4, 3
