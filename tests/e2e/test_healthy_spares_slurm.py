"""End to end on the real local Slurm: healthy spares only. 3 workers + 2 spares; the
user's health check (run as a step on each spare) fails on the first spare: the job
drains it with the check's reason, and when a node is lost it adopts the other spare;
the run ends bit-identical to a fault-free one."""

import json
import sys

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.slurm import commands

from .conftest import FAULT_STEP_TIME, STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


def _events(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


def test_a_spare_failing_its_health_check_is_drained_and_the_other_adopted(cluster, jobs_root, reference3, tmp_path):
    lab.cluster("reset")
    # the first spare of the allocation (n1 supervises, n2-n4 work, n5 and n6 are spares)
    probe = [sys.executable, "-c", "import os, sys; n = os.environ.get('SLURMD_NODENAME'); "
             "print('probe: ' + str(n) + ' is sick') if n == 'n5' else None; sys.exit(n == 'n5')"]
    cfg = tmp_path / "hc.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + "recovery:\n  health_check: " + json.dumps(probe) + "\n")
    run = lab.submit(jobs_root / "hc", nodes=3, spares=2, steps=STEPS, config=cfg, step_time=FAULT_STEP_TIME)
    st = run.wait_for_step(12)
    failed = _events(run.job_dir, "spare_check_failed")
    assert [e["node"] for e in failed] == ["n5"] and "probe: n5 is sick" in failed[0]["reason"], failed
    assert [e["node"] for e in _events(run.job_dir, "spare_checked")] == ["n6"]
    node = commands.show_nodes(["n5"])["n5"]
    assert "DRAIN" in node["State"] and "health check" in node.get("Reason", "")
    lab.kill_node(st["ranks"][1]["node"])
    assert run.wait() == 0, run.output()
    assert [e["level"] for e in _events(run.job_dir, "recovery_done")] == ["node-replacement"]
    assert _events(run.job_dir, "plan")[-1]["nodes"][1] == "n6"
    assert lab.compare_runs(reference3, run.job_dir / "final.pt") == []
