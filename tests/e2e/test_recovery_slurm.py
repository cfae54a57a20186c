"""End to end on the real local Slurm: faults in the middle of a 4-node job.

Every faulty run must finish with weights bit-identical (model and optimizer
state, torch.equal) to the fault-free reference, or fail cleanly where recovery
is impossible.
"""

import json
import os
import signal
import time

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.slurm import commands

from .conftest import FAULT_STEP_TIME, STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

KILL_AT = 12


def _events(job_dir, kind=None):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if kind is None or e["kind"] == kind]


def test_fault_free_run_completes(reference):
    job_dir = reference.parent
    assert reference.exists()
    assert _events(job_dir, "job_done")
    assert not _events(job_dir, "recovery_start")
    assert (job_dir / "ranktable-gen0000.json").exists()
    assert oct(os.stat(job_dir / "token").st_mode & 0o777) == "0o600"


def test_node_loss_finishes_on_spare_bit_identical(cluster, jobs_root, reference):
    run = lab.submit(jobs_root / "node-loss", steps=STEPS, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][1]["node"]
    spare = status["spares"][0]["node"]
    fault_at = lab.kill_node(victim)
    assert run.wait() == 0, run.output()
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []
    done = _events(run.job_dir, "recovery_done")
    assert [d["level"] for d in done] == ["node-replacement"]
    plans = _events(run.job_dir, "plan")
    assert plans[-1]["nodes"][1] == spare and victim not in plans[-1]["nodes"]
    summary = lab.summarize(run.job_dir, fault_at)
    assert summary["mttr_s"] > 0 and set(summary["phases"]) >= {"detect", "reconnect", "restore"}
    node = commands.show_nodes([victim])[victim]
    assert "DOWN" in node["State"] and "slurm_resilience" in node.get("Reason", "")


def test_rank_killed_on_healthy_node_restarts_in_place(cluster, jobs_root, reference):
    # the node standbys start at the job's first step: train long enough for their import
    run = lab.submit(jobs_root / "rank-kill", steps=STEPS, step_time=2 * FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][2]
    warm = _connected_standby(run, victim["node"])  # recovery.local_standbys (on by default)
    os.kill(victim["pid"], signal.SIGKILL)  # a process this test's job started
    assert run.wait() == 0, run.output()
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []
    assert [d["level"] for d in _events(run.job_dir, "recovery_done")] == ["online"]
    assert _events(run.job_dir, "plan")[-1]["nodes"][2] == victim["node"]
    # the node's warm standby took the slot: no new step was started for it
    assert [(e["rank"], e["worker_id"]) for e in _events(run.job_dir, "local_standby_adopted")] == \
        [(2, warm["worker_id"])]
    assert "DOWN" not in commands.show_nodes([victim["node"]])[victim["node"]]["State"]


def _connected_standby(run, node: str, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = [x for x in (run.status or {}).get("local_standbys", []) if x["node"] == node and x["connected"]]
        if got:
            return got[0]
        time.sleep(0.1)
    raise AssertionError(f"no connected standby on {node}: {run.status}")


def test_hung_rank_is_detected_by_heartbeat_and_replaced(cluster, jobs_root, reference):
    run = lab.submit(jobs_root / "rank-hang", steps=STEPS, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][3]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        assert run.wait() == 0, run.output()
    finally:
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []
    faults = _events(run.job_dir, "fault_detected")
    assert faults[0]["fault"]["kind"] == "process_hung"


def test_no_spare_left_fails_cleanly_and_keeps_state(cluster, jobs_root, tmp_path):
    cfg = tmp_path / "no-ladder.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + "recovery:\n  scale_in: false\n  max_requeues: 0\n")
    run = lab.submit(jobs_root / "no-spare", spares=0, steps=STEPS, config=cfg, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][1]["node"]
    lab.kill_node(victim)
    code = run.wait()
    out = run.output()
    assert code == 3, out
    errors = [line for line in out.splitlines() if line.startswith("slurm-resilience: error:")]
    assert len(errors) == 1 and "no spare left" in errors[0], out
    assert "Traceback" not in (run.job_dir / "supervisor.log").read_text()
    import torch

    snaps = sorted((run.job_dir / "snapshots").glob("rank*-step*.pt"))
    assert len(snaps) == 3, snaps  # every survivor persisted its state
    states = [torch.load(p, weights_only=False) for p in snaps]
    assert min(s["step"] for s in states) >= KILL_AT
    for p in snaps:
        assert oct(os.stat(p).st_mode & 0o777) == "0o600"


@pytest.mark.slow
def test_online_timeout_falls_back_to_relaunch_from_snapshots(cluster, jobs_root, reference, tmp_path):
    cfg = tmp_path / "fallback.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + "recovery:\n  online_timeout_s: 0.005\n")
    run = lab.submit(jobs_root / "fallback", steps=STEPS, config=cfg, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    lab.kill_node(status["ranks"][1]["node"])
    assert run.wait() == 0, run.output()
    assert _events(run.job_dir, "fallback")
    assert [d["level"] for d in _events(run.job_dir, "recovery_done")] == ["process-restart"]
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []


def test_submitit_path_survives_node_loss(cluster, jobs_root, reference):
    import sys

    from slurm_resilience.launch.submitit_launch import submit

    job_dir = jobs_root / "submitit"
    job = submit([sys.executable, str(lab.EXAMPLE), "--steps", str(STEPS), "--step-time", "0.05"],
                 nodes=4, spares=1, job_dir=str(job_dir), config=str(lab.LOCAL_CONFIG), timeout_min=10)
    run = lab.JobRun(job_dir=job_dir, process=None)
    status = _wait_status(run)
    lab.kill_node(status["ranks"][1]["node"])
    assert job.result() == 0
    assert lab.compare_runs(reference, job_dir / "final.pt") == []
    assert [d["level"] for d in _events(job_dir, "recovery_done")] == ["node-replacement"]


def _wait_status(run, step=KILL_AT, timeout=120):
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        st = run.status
        if st and st["ranks"] and min(r["step"] for r in st["ranks"]) >= step:
            return st
        time.sleep(0.1)
    raise TimeoutError(f"no step {step}: {run.status}")


def _config(tmp_path, name, extra):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + extra)
    return cfg


def test_no_spare_scales_in_and_finishes(cluster, jobs_root):
    run = lab.submit(jobs_root / "scale-in", spares=0, steps=STEPS, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][1]["node"]
    lab.kill_node(victim)
    assert run.wait() == 0, run.output()
    assert [d["level"] for d in _events(run.job_dir, "recovery_done")] == ["scale-in"]
    assert victim not in _events(run.job_dir, "plan")[-1]["nodes"]
    import torch

    final = torch.load(run.job_dir / "final.pt", weights_only=False)
    assert final["step"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("requeue_by", ["resubmit"])  # "requeue": as an ordinary user, test_unprivileged_slurm.py
def test_no_spare_no_scale_in_requeues_and_resumes_bit_identical(cluster, jobs_root, reference, tmp_path, requeue_by):
    cfg = _config(tmp_path, f"requeue-{requeue_by}",
                  f"recovery:\n  scale_in: false\n  max_requeues: 1\n  requeue_by: {requeue_by}\n")
    run = lab.submit(jobs_root / f"requeue-{requeue_by}", spares=0, steps=STEPS, config=cfg, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    lab.kill_node(status["ranks"][1]["node"])
    assert run.wait() == 0, run.output()
    assert _events(run.job_dir, "requeue")
    restored = [e for e in _events(run.job_dir, "rank_restored") if e.get("tier")]
    assert restored and restored[-1]["step"] >= 10  # resumed from a committed checkpoint
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []
    final = json.loads((run.job_dir / "status.json").read_text())
    assert final["requeue_count"] == 1, final  # counted against max_requeues either way
    if requeue_by == "resubmit":  # a new job id in the same job dir; the first job's L1 found
        chain = json.loads((run.job_dir / "resubmitted.json").read_text())["chain"]
        assert chain == {status["job_id"]: final["job_id"]} and final["job_id"] != status["job_id"], chain
        # node-local checkpoints under the first job's id: each rank at the newest step loads its
        # own L1 copy or its partner's (a rank behind it is streamed from one of them)
        assert all(e["tier"].startswith("L1") for e in restored), restored


@pytest.mark.slow
def test_online_then_process_restart_time_out_and_the_job_requeues(cluster, jobs_root, reference, tmp_path):
    """The ladder's fallbacks end to end: each level is forced to time out, so the next
    coarser one takes over: online → process restart (all relaunched) → job requeue."""
    cfg = _config(tmp_path, "fallbacks", "recovery:\n  online_timeout_s: 0.005\n"
                  "  fallback_timeout_s: 0.005\n  max_requeues: 1\n")
    run = lab.submit(jobs_root / "fallbacks", steps=STEPS, config=cfg, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    os.kill(status["ranks"][1]["pid"], signal.SIGKILL)
    assert run.wait() == 0, run.output()
    kinds = [e["kind"] for e in _events(run.job_dir) if e["kind"] in ("ladder", "fallback", "requeue")]
    assert kinds[:3] == ["ladder", "fallback", "requeue"], kinds
    assert _events(run.job_dir, "ladder")[0]["level"] == "online"
    restored = [e for e in _events(run.job_dir, "rank_restored") if e.get("tier")]
    assert restored and restored[-1]["step"] >= 10  # the requeued job resumed from a checkpoint
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []


# Preemption (SIGUSR2 → persist → requeue → exact resume) runs as an ordinary user in
# test_unprivileged_slurm.py, which asserts what a root run did here: one run fewer in CI.


@pytest.mark.slow
def test_scale_in_then_back_out_when_the_node_returns(cluster, jobs_root, tmp_path):
    cfg = _config(tmp_path, "scale-out", "recovery:\n  isolate_state: DRAIN\ndetect:\n  node_poll_s: 0.5\n")
    run = lab.submit(jobs_root / "scale-out", spares=0, steps=STEPS + 160, config=cfg)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][1]["node"]
    lab.kill_node(victim)
    deadline = time.time() + 30
    while not [e for e in _events(run.job_dir, "recovery_done") if e["level"] == "scale-in"]:
        assert time.time() < deadline, run.output()
        time.sleep(0.1)
    lab.cluster("revive-node", victim)  # an admin brings it back before Slurm declares it down
    assert run.wait() == 0, run.output()
    levels = [d["level"] for d in _events(run.job_dir, "recovery_done")]
    assert levels == ["scale-in", "scale-out"], levels
    assert _events(run.job_dir, "node_returned")[0]["node"] == victim
    final_plan = _events(run.job_dir, "plan")[-1]
    assert len(final_plan["nodes"]) == 4 and final_plan["nodes"][-1] == victim
    import torch

    final = torch.load(run.job_dir / "final.pt", weights_only=False)
    assert final["step"] == STEPS + 160


@pytest.mark.slow
def test_submitit_preemption_requeues_and_resumes_exactly(cluster, jobs_root, reference):
    import sys

    from slurm_resilience.launch.submitit_launch import submit

    job_dir = jobs_root / "submitit-preempt"
    job = submit([sys.executable, str(lab.EXAMPLE), "--steps", str(STEPS), "--step-time", "0.05"],
                 nodes=4, spares=1, job_dir=str(job_dir), config=str(lab.LOCAL_CONFIG), timeout_min=10)
    script = (job_dir / "submitit" / f"{job.job_id}_submission.sh").read_text()
    assert "#SBATCH --signal=USR2@60" in script and "#SBATCH --requeue" in script
    status = _wait_status(lab.JobRun(job_dir=job_dir, process=None))
    # what Slurm does before the time limit with --signal=USR2@60: signal every step
    commands.run(["scancel", "--signal=USR2", status["job_id"]])
    assert job.result() == 0
    persisted = _events(job_dir, "rank_persisted")
    assert len(persisted) == 4 and len({e["step"] for e in persisted}) == 1
    assert all(e["committed"] for e in persisted), persisted
    restored = [e for e in _events(job_dir, "rank_restored") if e.get("tier")]
    assert restored[-1]["step"] == persisted[0]["step"]
    assert lab.compare_runs(reference, job_dir / "final.pt") == []


@pytest.mark.slow
def test_killed_supervisor_reattaches_without_restarting_workers_then_recovers(cluster, jobs_root):
    """kill-supervisor: the batch step (which hosts the store) restarts it; the new one
    takes over the running ranks and spare, and still recovers a node loss after."""
    run = lab.submit(jobs_root / "kill-supervisor", steps=STEPS + 160)
    status = run.wait_for_step(KILL_AT)
    pids = [r["pid"] for r in status["ranks"]]
    os.kill(status["supervisor_pid"], signal.SIGKILL)
    deadline = time.time() + 60
    while not _events(run.job_dir, "supervisor_reattached"):
        assert time.time() < deadline, run.output()
        time.sleep(0.1)
    st = run.wait_for_step(KILL_AT + 20)
    assert st["supervisor_pid"] != status["supervisor_pid"]
    assert [r["pid"] for r in st["ranks"]] == pids  # nobody was restarted
    assert st["generation"] == status["generation"]
    lab.kill_node(st["ranks"][1]["node"])
    assert run.wait() == 0, run.output()
    assert [d["level"] for d in _events(run.job_dir, "recovery_done")] == ["node-replacement"]
    import torch

    assert torch.load(run.job_dir / "final.pt", weights_only=False)["step"] == STEPS + 160
