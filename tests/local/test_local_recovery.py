"""Tier 3: the real Supervisor and LocalLauncher on localhost, no Slurm.

Workers run examples/train_mlp.py as subprocesses (gloo on ``lo``). Faults are
injected once training has passed a step: a lost node (LocalLauncher.fail_node),
a SIGKILLed rank, and a lost node with no spare left. Recovered runs must end with
the same bits as a fault-free reference run.
"""

import os
import signal

import pytest
import torch

from .localjob import INJECT_AFTER, STEPS, assert_same_training as _assert_same_training, final_state as _final



@pytest.mark.timeout(240)
def test_node_loss_recovers_on_spare_bit_identical(job_factory, reference):
    job = job_factory()
    st = job.wait_for_step(INJECT_AFTER)
    lost = st["ranks"][0]["node"]  # rank 0's node: the source of most restores, and of final.pt
    job.launcher.fail_node(lost)
    assert job.wait() == 0, job.diag()
    _assert_same_training(_final(job), reference)
    events = job.events()
    done = [e for e in events if e["kind"] == "recovery_done"]
    assert done and done[0]["level"] == "node-replacement", job.diag()
    final_status = job.status()
    assert lost not in [r["node"] for r in final_status["ranks"]]
    assert lost in final_status["excluded"]


@pytest.mark.timeout(240)
def test_killed_rank_restarts_in_place_bit_identical(job_factory, reference):
    """recovery.local_standbys: the dead rank's slot goes to its node's warm standby (no
    process start), and a new standby is started on that node once the recovery is done."""
    job = job_factory(recovery={"local_standbys": True}, step_time=0.3)  # time for the standby to import
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][2]
    warm = job.local_standby(victim["node"])
    os.kill(victim["pid"], signal.SIGKILL)  # a worker process this job started
    assert job.wait() == 0, job.diag()
    _assert_same_training(_final(job), reference)
    events = job.events()
    done = [e for e in events if e["kind"] == "recovery_done"]
    assert done and done[0]["level"] == "online", job.diag()
    final_status = job.status()
    assert final_status["ranks"][2]["node"] == victim["node"]
    assert final_status["ranks"][2]["worker_id"] == warm["worker_id"] != victim["worker_id"]
    assert final_status["ranks"][2]["pid"] == warm["pid"]  # the standby's own process, already running
    adopted = [e for e in events if e["kind"] == "local_standby_adopted"]
    assert [(e["rank"], e["worker_id"]) for e in adopted] == [(2, warm["worker_id"])], job.diag()
    assert not (job.job_dir / "logs" / f"{warm['worker_id']}.log").read_text().count("Traceback")
    # the background refill: after the recovery, a new standby on the victim's node
    refill = [e for e in events if e["kind"] == "local_standby_started" and e["generation"] >= 1]
    assert [e["node"] for e in refill] == [victim["node"]], job.diag()
    assert events.index(done[0]) < events.index(refill[0])
    assert refill[0]["worker_id"] not in (warm["worker_id"], victim["worker_id"])
    assert any(s["worker_id"] == refill[0]["worker_id"] for s in final_status["local_standbys"])



@pytest.mark.timeout(240)
def test_node_loss_without_spare_aborts_and_keeps_state(job_factory):
    job = job_factory(spares=0, recovery={"scale_in": False})
    st = job.wait_for_step(INJECT_AFTER)
    job.launcher.fail_node(st["ranks"][1]["node"])
    assert job.wait() == 3, job.diag()
    snaps = sorted((job.job_dir / "snapshots").glob("rank*-step*.pt"))
    assert snaps, job.diag()
    state = torch.load(snaps[0], weights_only=False)
    assert state["step"] >= INJECT_AFTER and "model" in state["objects"]
    assert any(e["kind"] == "job_failed" for e in job.events())
    assert not (job.job_dir / "final.pt").exists()


def test_node_loss_without_spare_scales_in_and_finishes(job_factory):
    job = job_factory(spares=0)
    status = job.wait_for_step(INJECT_AFTER)
    job.launcher.fail_node(status["ranks"][1]["node"])
    assert job.wait() == 0, job.diag()
    done = [e for e in job.events() if e["kind"] == "recovery_done"]
    assert done and done[0]["level"] == "scale-in", job.diag()
    plans = [e for e in job.events() if e["kind"] == "plan"]
    assert len(plans[-1]["nodes"]) == 2 and status["ranks"][1]["node"] not in plans[-1]["nodes"]
    final = _final(job)
    assert final["step"] == STEPS
    # every global sample position was consumed exactly once across the change of world size
    restored = [e for e in job.events() if e["kind"] == "rank_restored" and e["generation"] == 1]
    k = restored[0]["step"]
    assert restored[0]["position"] == k * 3 * 16
    assert final["position"] == k * 3 * 16 + (STEPS - k) * 2 * 16


def test_straggler_is_reported_and_migrated_to_a_spare_without_losing_a_step(job_factory, reference):
    job = job_factory(recovery={"migrate_stragglers": True}, detect={"straggler_window": 4},
                      extra_args=("--slow-node", "local2", "--slow-ms", "40"))
    assert job.wait() == 0, job.diag()
    ev = job.events()
    stragglers = [e for e in ev if e["kind"] == "straggler"]
    assert stragglers and stragglers[0]["node"] == "local2" and stragglers[0]["rank"] == 1
    done = [e for e in ev if e["kind"] == "recovery_done"]
    assert [d["level"] for d in done] == ["straggler-migration"]
    assert [e for e in ev if e["kind"] == "plan"][-1]["nodes"][1] == "local4"
    assert not [e for e in ev if e["kind"] == "fault_detected"]  # planned, not a failure
    _assert_same_training(_final(job), reference)
