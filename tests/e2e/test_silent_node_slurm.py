"""End to end on the real local Slurm: a node that goes silent mid-run.

``local-cluster freeze-node`` stops the node's slurmd and freezes its job cgroups:
no process dies, no connection closes, slurmd's port still accepts TCP. The
supervisor must call the node lost (every rank there stale + slurmd silent to a
Slurm request), not restart a "hung" process in place on it, and finish on the
spare with weights bit-identical to the fault-free run. The frozen node is thawed
and revived afterwards whatever happens, so the shared cluster is left healthy.
"""

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

from .conftest import STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

FREEZE_AT = 12


def _events(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


def test_frozen_node_is_lost_and_replaced_on_the_spare(cluster, jobs_root, reference):
    run = lab.submit(jobs_root / "node-freeze", steps=STEPS)
    status = run.wait_for_step(FREEZE_AT)
    victim = status["ranks"][1]["node"]
    spare = status["spares"][0]["node"]
    frozen_at = lab.freeze_node(victim)
    try:
        assert run.wait() == 0, run.output()
    finally:
        lab.thaw_and_revive(victim)
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []  # rank 0's final.pt + every rank's digest
    faults = _events(run.job_dir, "fault_detected")
    lost = [f for f in faults if f["fault"]["node"] == victim]
    assert lost and all(f["fault"]["kind"] == "node_lost" for f in lost), faults
    assert all(f["fault"]["kind"] != "process_hung" for f in faults), faults
    first = lost[0]
    # the verdict came from the slurmd probe (sstat unanswered), not from Slurm
    # flagging the node after SlurmdTimeout; probe_s = detection → verdict (negative
    # when the early probe had answered before the heartbeats went stale)
    assert first["slurmd_answers"] is False and isinstance(first["probe_s"], float), first
    assert first["observed_at"] >= frozen_at
    assert "did not answer" in first["fault"]["detail"], first
    done = _events(run.job_dir, "recovery_done")
    assert [d["level"] for d in done] == ["node-replacement"], done
    plans = _events(run.job_dir, "plan")
    assert plans[-1]["nodes"][1] == spare and victim not in plans[-1]["nodes"]
    summary = lab.summarize(run.job_dir, frozen_at)
    print(f"frozen node: fault → first step {summary['mttr_s']:.3f} s; detect→probe verdict "
          f"{first['probe_s']:.3f} s; phases {lab.format_summary(summary, frozen_at)}")
