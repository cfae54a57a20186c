"""Sharded optimizer state (examples/train_zero.py) through a scale-in: every slice is
restored from the newest complete checkpoint and resharded from 3 ranks to 2.

"Identical" at a changed world size means: the job that lost a node ends bit-identical
to a fresh 2-rank job resumed from the same checkpoint step (the resharding is exact
and the data position is global); it cannot equal a run that stayed at 3 ranks, whose
gradient sums are grouped differently.
"""

import shutil
from pathlib import Path

import pytest

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import shard_crc32

from .localjob import INJECT_AFTER, ZERO, LocalJob, assert_bit_identical, final_state

pytestmark = pytest.mark.timeout(240)
CKPT = {"local_every": 5, "shared_every_kth": 1, "shared_keep": 20, "local_keep": 20}
STEPS = 40


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def _run(job: LocalJob) -> LocalJob:
    try:
        assert job.wait(180) == 0, job.diag()
    finally:
        job.kill_leftovers()
    return job


def test_scale_in_reshards_sharded_state_exactly(tmp_path):
    a = LocalJob(tmp_path, nodes=3, spares=0, steps=STEPS, script=ZERO, checkpoint=CKPT, job_name="a").start()
    st = a.wait_for_step(INJECT_AFTER + 6)  # past the checkpoints of steps 5 and 10
    a.launcher.fail_node(st["ranks"][1]["node"])
    _run(a)
    assert [d["level"] for d in _events(a, "recovery_done")] == ["scale-in"]
    resharded = [e for e in _events(a, "rank_restored") if e.get("resharded")]
    assert len(resharded) == 2 and len({e["step"] for e in resharded}) == 1, resharded
    step = resharded[0]["step"]
    assert step >= 10 and step % 5 == 0

    # B: a fresh 2-rank job that starts from the same step. Its shared tier gets that
    # step's three shards as A's node-local tiers held them (rank r ran on local{r+1}).
    dst = tmp_path / "b" / "checkpoints"
    shards = {}
    for r in range(3):
        src = mf.shard_path(str(tmp_path / "local" / f"local{r + 1}" / "ckpt"), step, r)
        to = mf.shard_path(str(dst), step, r)
        Path(to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, to)
        shards[r] = mf.ShardRecord(mf.shard_name(r), Path(to).stat().st_size, shard_crc32(to))
    mf.write_manifest(str(dst), mf.Manifest(step=step, world_size=3, tier="L2", shards=shards,
                                            created=0.0, extra={}))
    mf.set_latest(str(dst), step)
    b = _run(LocalJob(tmp_path, nodes=2, spares=0, steps=STEPS, script=ZERO, checkpoint=CKPT, job_name="b",
                      local_dir=tmp_path / "local-b").start())
    restored_b = [e for e in _events(b, "rank_restored") if e.get("resharded")]
    assert restored_b and {e["step"] for e in restored_b} == {step}

    fa, fb = final_state(a), final_state(b)
    assert fa["step"] == fb["step"] == STEPS
    assert_bit_identical(fa["objects"], fb["objects"], "objects")  # model + rank 0's momentum slice
    assert fa["objects"]["optimizer"]["shards"]["momentum"].numel() == (32 * 64 + 64 + 64 * 4 + 4 + 1) // 2


def test_node_replacement_rebuilds_the_lost_slice_from_xor_bit_identical(tmp_path):
    """World size unchanged: a lost node's momentum slice comes back from XOR parity
    (no partner copy, no shared tier) and the job ends bit-identical to a fault-free run."""
    ckpt = {"local_every": 5, "local_redundancy": "xor", "local_xor_group_size": 3, "shared_every_kth": 0}
    ref = _run(LocalJob(tmp_path, nodes=3, spares=0, steps=STEPS, script=ZERO, checkpoint=ckpt, job_name="ref",
                        local_dir=tmp_path / "local-ref").start())
    job = LocalJob(tmp_path, nodes=3, spares=1, steps=STEPS, script=ZERO, checkpoint=ckpt, job_name="job").start()
    st = job.wait_for_step(INJECT_AFTER + 6)
    job.launcher.fail_node(st["ranks"][1]["node"])
    _run(job)
    assert [d["level"] for d in _events(job, "recovery_done")] == ["node-replacement"]
    rebuilt = [e for e in _events(job, "rank_checkpoint_rebuilt") if e["ranks"]]
    assert rebuilt and rebuilt[0]["ranks"] == [1], _events(job, "rank_checkpoint_rebuilt")
    restored = [e for e in _events(job, "rank_restored") if e.get("resharded")]
    assert len({e["step"] for e in restored}) == 1 and restored[0]["step"] >= 10
    assert_bit_identical(final_state(job)["objects"], final_state(ref)["objects"], "objects")
