"""Sharded optimizer state (examples/train_zero.py) through a scale-in: every slice is
restored from the newest complete checkpoint and resharded from 3 ranks to 2.

"Identical" at a changed world size means: the job that lost a node ends bit-identical
to a fresh 2-rank job resumed from the same checkpoint step (the resharding is exact
and the data position is global); it cannot equal a run that stayed at 3 ranks, whose
gradient sums are grouped differently.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import read_shard
from slurm_resilience.cli import main as cli_main

from .localjob import GATHERED_RUN, INJECT_AFTER, ZERO, LocalJob, assert_bit_identical, final_state, gather_l1

pytestmark = pytest.mark.timeout(300)
DCP_LOAD = Path(__file__).with_name("dcp_load.py")  # torch alone: no slurm_resilience import
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
    gather_l1(tmp_path / "local", step, dst)
    dcp_dir = _export_and_load_with_dcp_alone(dst, step, tmp_path)
    b = _run(LocalJob(tmp_path, nodes=2, spares=0, steps=STEPS, script=ZERO, checkpoint=CKPT, job_name="b",
                      local_dir=tmp_path / "local-b", run_id=GATHERED_RUN).start())
    restored_b = [e for e in _events(b, "rank_restored") if e.get("resharded")]
    assert restored_b and {e["step"] for e in restored_b} == {step}

    fa, fb = final_state(a), final_state(b)
    assert fa["step"] == fb["step"] == STEPS
    assert_bit_identical(fa["objects"], fb["objects"], "objects")  # model + rank 0's momentum slice
    assert fa["objects"]["optimizer"]["shards"]["momentum"].numel() == (32 * 64 + 64 + 64 * 4 + 4 + 1) // 2

    # C: a fresh 2-rank job started from the DCP export of that step (checkpoint.init_from)
    # trains exactly as B, which started from the toolkit's own checkpoint of it.
    c = _run(LocalJob(tmp_path, nodes=2, spares=0, steps=STEPS, script=ZERO, job_name="c",
                      checkpoint={**CKPT, "init_from": str(dcp_dir)}, local_dir=tmp_path / "local-c").start())
    restored_c = _events(c, "rank_restored")
    assert {(e["tier"], e["step"]) for e in restored_c[:2]} == {("init_from", step)}, restored_c
    fc = final_state(c)
    assert fc["step"] == STEPS
    assert_bit_identical(fc["objects"], fb["objects"], "objects")


def _export_and_load_with_dcp_alone(root: Path, step: int, tmp_path: Path) -> Path:
    """``ckpt export`` the 3-rank step as DCP; plain DCP (no toolkit import) loads it at
    world size 1 and 2 (FSDP2 model, DTensor momentum): the same tensors as the shards."""
    out = tmp_path / "dcp"
    assert cli_main(["ckpt", "export", str(root), "--step", str(step), "--format", "dcp", str(out)]) == 0
    ranks = [read_shard(mf.shard_path(str(root), step, r))[0] for r in range(3)]
    momentum = torch.cat([s["objects"]["optimizer"]["shards"]["momentum"] for s in ranks])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for world, local in ((1, [momentum.numel()]), (2, [momentum.numel() // 2] * 2)):
        got = tmp_path / f"dcp-load-{world}.pt"
        proc = subprocess.run([sys.executable, str(DCP_LOAD), str(out), str(world), str(got)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        loaded = torch.load(got, weights_only=True)
        assert loaded["local"] == local and (loaded["step"], loaded["position"]) == (step, ranks[0]["position"])
        assert_bit_identical(loaded["model"], ranks[0]["objects"]["model"], f"model at world {world}")
        assert torch.equal(loaded["momentum"], momentum), f"momentum at world {world}"
    return out


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
