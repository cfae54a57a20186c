"""End to end on the real local Slurm: the ordinary DDP script (examples/train_ddp.py:
DataLoader workers, AMP GradScaler, LR scheduler, gradient accumulation, eval with
dist.all_reduce) with 2 ranks per node (2 nodes x 2 ranks + a spare node with 2 warm
standbys). A node killed mid-run: every rank's final state equals the fault-free run's."""

from pathlib import Path

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
G = 2
STEPS = 30
KILL_AT = 10
DETECT = "detect:\n  heartbeat_timeout_s: 8\n  standby_heartbeat_timeout_s: 16\n"  # see test_multi_rank_slurm


def _submit(jobs_root, tmp_path, name):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + DETECT)
    return lab.submit(jobs_root / name, nodes=2, spares=1, tasks_per_node=G, steps=STEPS, step_time=0.1,
                      config=cfg, script=SCRIPT)


def _events(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


def test_ddp_script_node_killed_is_bit_identical_on_every_rank(cluster, jobs_root, tmp_path):
    ref = _submit(jobs_root, tmp_path, "ddp-reference")
    assert ref.wait() == 0, ref.output()
    assert not _events(ref.job_dir, "recovery_start")
    digests = lab.rank_digests(ref.job_dir)
    assert sorted(digests) == list(range(2 * G)), digests

    run = _submit(jobs_root, tmp_path, "ddp-node-loss")
    st = run.wait_for_step(KILL_AT)
    lab.kill_node(st["ranks"][2]["node"])  # ranks 2 and 3
    assert run.wait() == 0, run.output()
    assert [e["level"] for e in _events(run.job_dir, "recovery_done")] == ["node-replacement"]
    assert lab.compare_states(ref.job_dir / "final.pt", run.job_dir / "final.pt") == []
    assert lab.rank_digests(run.job_dir) == digests
