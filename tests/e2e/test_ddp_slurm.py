"""End to end on the real local Slurm: the ordinary DDP script (examples/train_ddp.py:
DataLoader workers, AMP GradScaler, LR scheduler, gradient accumulation, eval with
dist.all_reduce) with 2 ranks per node (2 nodes x 2 ranks + a spare node with 2 warm
standbys). A node killed mid-run: every rank's final state equals the fault-free run's.
With no spare and scale-in off, the job is requeued and resumes from its checkpoint at
the exact data position, again ending equal to the fault-free run on every rank."""

from pathlib import Path

import pytest
import torch

from slurm_resilience import lab
from slurm_resilience.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
G = 2
STEPS = 30
KILL_AT = 10
BATCH = 16  # --batch: samples per rank per step
DETECT = "detect:\n  heartbeat_timeout_s: 8\n  standby_heartbeat_timeout_s: 16\n"  # see test_multi_rank_slurm


def _submit(jobs_root, cfg_dir, name, *, spares=1, extra=""):
    cfg = cfg_dir / f"{name}.yaml"
    text = lab.LOCAL_CONFIG.read_text()
    if extra:  # a requeued job may land on other nodes (no L1 there): drain every L1 to the shared tier
        assert "shared_every_kth: 2" in text
        text = text.replace("shared_every_kth: 2", "shared_every_kth: 1")
    cfg.write_text(text + DETECT + extra)
    return lab.submit(jobs_root / name, nodes=2, spares=spares, tasks_per_node=G, steps=STEPS, step_time=0.1,
                      config=cfg, script=SCRIPT)


def _events(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


@pytest.fixture(scope="module")
def ddp_reference(slurm_cluster, jobs_root, tmp_path_factory):
    lab.cluster("reset")
    ref = _submit(jobs_root, tmp_path_factory.mktemp("ddp-cfg"), "ddp-reference")
    assert ref.wait() == 0, ref.output()
    assert not _events(ref.job_dir, "recovery_start")
    digests = lab.rank_digests(ref.job_dir)
    assert sorted(digests) == list(range(2 * G)), digests
    return ref.job_dir


def test_ddp_script_node_killed_is_bit_identical_on_every_rank(cluster, jobs_root, tmp_path, ddp_reference):
    run = _submit(jobs_root, tmp_path, "ddp-node-loss")
    st = run.wait_for_step(KILL_AT)
    lab.kill_node(st["ranks"][2]["node"])  # ranks 2 and 3
    assert run.wait() == 0, run.output()
    assert [e["level"] for e in _events(run.job_dir, "recovery_done")] == ["node-replacement"]
    assert lab.compare_states(ddp_reference / "final.pt", run.job_dir / "final.pt") == []
    assert lab.rank_digests(run.job_dir) == lab.rank_digests(ddp_reference)


def test_ddp_script_requeued_resumes_at_the_exact_data_position_bit_identical(cluster, jobs_root, tmp_path,
                                                                               ddp_reference):
    """No spare, scale-in off: a lost node requeues the job (benchmarks' `requeue` case);
    the requeued job restores its newest checkpoint (L1 every 10 steps, each drained to L2), its loader
    continues at that step's global sample position, and every rank ends bit-identical."""
    run = _submit(jobs_root, tmp_path, "ddp-requeue", spares=0,
                  extra="recovery:\n  scale_in: false\n  max_requeues: 1\n")
    st = run.wait_for_step(KILL_AT + 2)  # past the step-10 checkpoint
    lab.kill_node(st["ranks"][2]["node"])  # ranks 2 and 3
    assert run.wait() == 0, run.output()
    events = read_events(str(run.job_dir / "events.jsonl"))
    kinds = [e["kind"] for e in events]
    assert kinds.count("requeue") == 1, run.output()
    resumed = [e for e in events[kinds.index("requeue"):] if e["kind"] == "rank_restored"]
    tiers = {e["tier"] for e in resumed if e.get("tier")}
    assert len(resumed) == 2 * G and tiers and "live" not in tiers, resumed  # read from a checkpoint tier
    step = resumed[0]["step"]
    assert step >= KILL_AT and step % 10 == 0, resumed  # a committed checkpoint, not step 0
    assert {(e["step"], e["position"]) for e in resumed} == {(step, step * 2 * G * BATCH)}, resumed
    final = torch.load(run.job_dir / "final.pt", weights_only=False)
    assert final["step"] == STEPS and final["position"] == STEPS * 2 * G * BATCH
    assert lab.compare_runs(ddp_reference, run.job_dir) == []  # rank 0's state and every rank's digest
