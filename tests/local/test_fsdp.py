"""FSDP2 (``session.fsdp``, tests/local/train_fsdp_tiny.py) under the real Supervisor, 3 ranks.

* a node lost and replaced by a spare, and a rank killed while it writes its L1 shard
  (restarted in place; the torn step is never used): every rank ends bit-identical to a
  fault-free run (same world size: same torch.chunk shards, same reduce-scatter order);
* a node lost, no spare: the job scales in to 2 ranks from the newest complete
  checkpoint (resharded 3 → 2) and ends bit-identical to a fresh 2-rank job started
  from that step's checkpoint (the definition of tests/local/test_sharded_state.py);
* DCP out and in: the reference run's last checkpoint, exported with ``ckpt export``,
  loads into plain FSDP2 code at 2 ranks (tests/local/dcp_load_fsdp.py, torch alone);
  what that code then saves with ``dcp.save`` starts a toolkit job (``init_from``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.shared_read import read_rank_state
from slurm_resilience.cli import main as cli_main

from .localjob import GATHERED_RUN, LocalJob, assert_bit_identical, final_state, gather_l1, rank_digests

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).with_name("train_fsdp_tiny.py")
DCP_LOAD = Path(__file__).with_name("dcp_load_fsdp.py")  # torch alone: no slurm_resilience import
STEPS = 16
CKPT = {"local_every": 4, "local_keep": 10, "shared_every_kth": 0}
SLOW_BOX = {"heartbeat_timeout_s": 8, "standby_heartbeat_timeout_s": 16}  # 2-core box: see test_multi_rank


FAULT_STEP_TIME = 0.3  # a node failed at step 6 must find the job still running (~3 s left)


def _job(root, name, step_time=0.05, **kw) -> LocalJob:
    kw.setdefault("checkpoint", CKPT)
    kw.setdefault("steps", STEPS)
    return LocalJob(root, step_time=step_time, script=SCRIPT, job_name=name, detect=SLOW_BOX,
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
    """Fault-free, 3 ranks: every rank's final digest, rank 0's final state, the run's root."""
    root = tmp_path_factory.mktemp("fsdp-ref")
    ref = _run(_job(root, "ref", nodes=3, spares=0))
    assert not _events(ref, "fault_detected")
    digests = rank_digests(ref)
    assert sorted(digests) == [0, 1, 2]
    return digests, final_state(ref), root


def _same_as_reference(job, reference):
    digests, ref, _ = reference
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
    gather_l1(tmp_path / "local-a", step, tmp_path / "b" / "checkpoints")
    b = _run(_job(tmp_path, "b", nodes=2, spares=0, checkpoint={**CKPT, "shared_every_kth": 1}, run_id=GATHERED_RUN))
    assert {e["step"] for e in _events(b, "rank_restored") if e.get("resharded")} == {step}
    assert sorted(rank_digests(a)) == [0, 1] and rank_digests(a) == rank_digests(b)
    fa, fb = final_state(a), final_state(b)
    assert fa["step"] == fb["step"] == STEPS
    assert_bit_identical(fa["objects"], fb["objects"], "objects")
    assert fa["objects"]["model"]["shards"]["3.weight"].numel() == 4 * 7  # 7 rows over 2 ranks: 4, 3


def _assert_same_fsdp_state(got, want, where):
    """``got`` (model by FQN, optimizer state by FQN, param groups, scheduler) equals the
    export's full state ``want``, bit for bit."""
    assert got["model"].keys() == want["model"].keys() and want["model"], where
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t), f"{where}: model[{k!r}]"
    assert got["optimizer"].keys() == want["optimizer"]["state"].keys() and want["optimizer"]["state"], where
    for fqn, per in want["optimizer"]["state"].items():
        assert per.keys() == {"step", "exp_avg", "exp_avg_sq"} and got["optimizer"][fqn].keys() == per.keys(), where
        for k, t in per.items():
            assert torch.equal(got["optimizer"][fqn][k], t), f"{where}: optimizer[{fqn!r}][{k!r}]"
    for g, w in zip(got["param_groups"], want["optimizer"]["param_groups"], strict=True):
        assert g == w, f"{where}: param groups"
    assert got["scheduler"] == {k: v for k, v in want["scheduler"].items() if k != "lr_lambdas"}, where


def test_dcp_export_loads_into_plain_fsdp2_and_plain_dcp_starts_a_job(tmp_path, reference):
    """Out: the reference's step-16 checkpoint (3 ranks), exported as DCP through the
    CLI, loads with torch alone into a fresh 2-rank FSDP2 model + AdamW (get_state_dict
    → dcp.load → set_state_dict): every parameter, moment, step, param group and the
    scheduler equal the ``--format torch`` export of the same step, which equals the
    ranks' slices. In: what that plain code saves (``dcp.save`` of model, optimizer,
    scheduler at 2 ranks) starts a 3-rank toolkit job (``checkpoint.init_from``): its
    first step starts from exactly that state, and it trains on."""
    _, ref, root = reference
    step = STEPS
    gather_l1(root / "local-ref", step, tmp_path / "l2")
    out, pt = tmp_path / "export", tmp_path / "export.pt"
    for fmt, to in (("dcp", out), ("torch", pt)):
        assert cli_main(["ckpt", "export", str(tmp_path / "l2"), "--step", str(step), "--format", fmt, str(to)]) == 0
    want = torch.load(pt, weights_only=True)
    assert (want["step"], want["position"]) == (step, ref["position"])
    slices = ref["objects"]  # rank 0's final state: rows 0..2 of 7, of 2 rows 0..0
    for path, flat in slices["model"]["shards"].items():
        full = want["model"][path]
        assert torch.equal(full[:-(-full.shape[0] // 3)].reshape(-1), flat), path
    for path, flat in slices["optimizer"]["shards"].items():
        _, fqn, k = path.split("/")
        full = want["optimizer"]["state"][fqn][k]
        assert torch.equal(full[:-(-full.shape[0] // 3)].reshape(-1), flat), path

    plain, got_pt = tmp_path / "plain-dcp", tmp_path / "loaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(DCP_LOAD), str(out), "2", str(got_pt), str(plain)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(got_pt, weights_only=True)
    assert got["local_rows"] == [4, 3] and (got["step"], got["position"]) == (step, want["position"])
    _assert_same_fsdp_state(got, want, "plain FSDP2 at 2 ranks")

    first = tmp_path / "first.pt"
    job = _run(_job(tmp_path, "imp", nodes=3, spares=0, steps=4, checkpoint={**CKPT, "init_from": str(plain)},
                    extra_args=("--dump-first", str(first))))
    assert {(e["tier"], e["step"]) for e in _events(job, "rank_restored")} == {("init_from", 0)}
    dumped = torch.load(first, weights_only=True)
    assert dumped["step"] == 0  # plain DCP has no step: the job counts from 0
    _assert_same_fsdp_state({"model": dumped["model"], "optimizer": dumped["optimizer"]["state"],
                             "param_groups": dumped["optimizer"]["param_groups"],
                             "scheduler": dumped["scheduler"]}, want, "the imported job's first step")
    # the imported step the job wrote (as it writes step 0) holds rows, not full tensors,
    # and is the DCP's state again
    gather_l1(tmp_path / "local-imp", 0, tmp_path / "l2-imp")
    rank0 = read_rank_state(mf.shard_path(str(tmp_path / "l2-imp"), 0, 0))["objects"]["optimizer"]
    assert rank0["shards"]["state/0.weight/exp_avg"].numel() == 3 * 6  # rows 3, 3, 1 of 7
    assert rank0["replicated"]["state"]["0.weight"].keys() == {"step"}
    assert cli_main(["ckpt", "export", str(tmp_path / "l2-imp"), "--format", "torch", str(tmp_path / "imp.pt")]) == 0
    again = torch.load(tmp_path / "imp.pt", weights_only=True)
    assert_bit_identical(again["model"], want["model"], "model")
    assert_bit_identical(again["optimizer"], want["optimizer"], "optimizer")
    end = final_state(job)
    assert end["step"] == 4
    assert int(end["objects"]["optimizer"]["replicated"]["state"]["0.weight"]["step"]) == step + 4
    assert not torch.equal(end["objects"]["model"]["shards"]["0.weight"], want["model"]["0.weight"][:3].reshape(-1))
