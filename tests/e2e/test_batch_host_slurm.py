"""End to end on the real local Slurm: losing the batch host (supervisor + store).

The batch step on the allocation's first node hosts the job's store and runs the
supervisor. Its node is killed mid-run: the ranks lose the store, keep training for
``detect.headless_timeout_s``, persist their newest state to the shared tier, and one
of them requeues the job without the lost node; the requeued job resumes from that
state and ends bit-identical to the fault-free reference. The same for a het job
(``submit --hetjob``) whose component 0 (supervisor + store, a node of its own) is lost:
Slurm requeues the whole het job once the ranks mark that node DOWN.
"""

import json
import time

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.slurm import commands
from slurm_resilience.slurm.parse import parse_scontrol_jobs

from .conftest import STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

KILL_AT = 8


def _persisted_steps(marks_dir):
    """The steps the ranks of the first run persisted (``r0-rankR``: ``TIME STEP``), once all 4 have."""
    deadline = time.time() + 30
    while len(marks := list(marks_dir.glob("r0-rank*"))) < 4:
        assert time.time() < deadline, [p.name for p in marks]
        time.sleep(0.2)
    return [int(p.read_text().split()[1]) for p in marks]


def test_batch_host_loss_persists_requeues_and_finishes_bit_identical(cluster, jobs_root, reference, tmp_path):
    cfg = tmp_path / "headless.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + "detect:\n  headless_timeout_s: 3\n")
    # no spare: the allocation after the requeue is the 4 workers' nodes + a free node
    # as batch host (the lost one is excluded); step time 0.3 s: still training when due
    run = lab.submit(jobs_root / "batch-host", spares=0, steps=STEPS, step_time=0.3, config=cfg)
    status = run.wait_for_step(KILL_AT)
    job_id = status["job_id"]
    host = commands.show_job(job_id)["BatchHost"]
    assert host not in [r["node"] for r in status["ranks"]]
    try:
        lab.kill_node(host)
        # every rank persists once the store has been gone for 3 s (fail fast, not at the wait)
        marks_dir = run.job_dir / "headless"
        deadline = time.time() + 90
        while len(list(marks_dir.glob("r0-rank*"))) < 4:
            assert time.time() < deadline, f"no headless persist within 90 s: {run.output()}"
            time.sleep(0.2)
        persisted = _persisted_steps(marks_dir)  # (a step a regular checkpoint had committed: not rewritten)
        assert run.wait(timeout=180) == 0, run.output()
    finally:  # a job left headless would hold the shared cluster's nodes until its time limit
        if run.process.poll() is None:
            commands.run(["scancel", str(job_id)], check=False)
            run.process.kill()
        node = commands.show_nodes([host])[host]
        lab.cluster("revive-node", host)  # the shared cluster gets its node back at once
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []  # rank 0's final.pt + every rank's digest
    job = commands.show_job(job_id)
    assert job["Restarts"] == "1", job  # (ExcNodeList: the update after the requeue may be refused)
    # the requeuing rank marked the lost host DOWN (its slurmd did not answer; root here)
    assert "DOWN" in node["State"] and "slurm_resilience" in node.get("Reason", ""), node
    marks = sorted(p.name for p in (run.job_dir / "headless").glob("r0-rank*"))
    assert marks == [f"r0-rank{r}" for r in range(4)], marks
    assert min(persisted) > KILL_AT, persisted
    # the requeued run restored the newest persisted step, not an older checkpoint
    restored = [e for e in read_events(str(run.job_dir / "events.jsonl"))
                if e["kind"] == "rank_restored" and e.get("tier")]
    assert restored and restored[-1]["step"] == max(persisted), restored


def test_hetjob_component0_loss_persists_requeues_and_finishes_bit_identical(cluster, jobs_root, reference, tmp_path):
    cfg = tmp_path / "headless.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + "detect:\n  headless_timeout_s: 3\n")
    # component 0 on one node, component 1 on 4 workers, no spare: a free node is left for
    # component 0 after the requeue (the lost one excluded)
    run = lab.submit(jobs_root / "hetjob-head", spares=0, steps=STEPS, step_time=0.3, config=cfg, hetjob=True)
    status = run.wait_for_step(KILL_AT)
    job_id = status["job_id"]  # the het-job leader: component 0
    leader = commands.show_job(job_id)
    host, workers = leader["BatchHost"], [r["node"] for r in status["ranks"]]
    assert leader.get("HetJobOffset") == "0" and host not in workers, (leader, workers)
    try:
        killed_at = lab.kill_node(host)
        marks_dir = run.job_dir / "headless"
        deadline = time.time() + 90
        while not list(marks_dir.glob("r0-requeue-rank*")):  # fail fast, not at the wait
            assert time.time() < deadline, f"no headless requeue within 90 s: {run.output()}"
            time.sleep(0.2)
        persisted = _persisted_steps(marks_dir)
        assert run.wait(timeout=180) == 0, run.output()
    finally:  # never leave the shared cluster a headless job or a dead node
        if run.process.poll() is None:
            commands.run(["scancel", str(job_id)], check=False)
            run.process.kill()
        node = commands.show_nodes([host])[host]
        lab.cluster("revive-node", host)
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []  # rank 0's final.pt + every rank's digest
    said = {p.name: json.loads(p.read_text()) for p in marks_dir.glob("r0-requeue-rank*")}
    # the rank marked component 0's node DOWN; Slurm then requeued the whole het job itself
    # and the rank kept the node out of component 0 (the later turns found it done)
    assert "DOWN" in node["State"] and "slurm_resilience" in node.get("Reason", ""), node
    acted = [r for r in said.values() if r["said"].startswith(f"Slurm requeued job {job_id} itself")]
    assert len(acted) == 1 and "failed" not in acted[0]["said"], said
    records = parse_scontrol_jobs(commands.run(["scontrol", "-o", "show", "job", job_id]).stdout)
    assert sorted(r["HetJobOffset"] for r in records.values()) == ["0", "1"], records
    for r in records.values():  # both components ran again, neither on the host
        assert r["HetJobId"] == job_id and host not in commands.hostnames(r["NodeList"]), r
    assert records[job_id]["Restarts"] == "1", records  # the leader's count (component 1's is not reliable)
    assert host in commands.hostnames(records[job_id]["ExcNodeList"]), records  # component 0's, for good
    assert sorted(p.name for p in marks_dir.glob("r0-rank*")) == [f"r0-rank{r}" for r in range(4)]
    assert min(persisted) > KILL_AT, persisted
    restored = [e for e in read_events(str(run.job_dir / "events.jsonl"))
                if e["kind"] == "rank_restored" and e.get("tier")]
    assert restored and restored[-1]["step"] == max(persisted), restored
    persisted_at = max(p.stat().st_mtime for p in marks_dir.glob("r0-rank*"))
    print(f"hetjob component 0 lost: persisted +{persisted_at - killed_at:.1f}s, requeue recorded "
          f"+{acted[0]['t'] - killed_at:.1f}s, restored +{restored[-1]['t'] - killed_at:.1f}s")
