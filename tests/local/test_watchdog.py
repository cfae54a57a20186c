"""Tier 3, the step-progress watchdog (supervisor/progress.py, worker/pulse.py): a rank
whose main thread is stuck while its process and heartbeat thread live on is found and
recovered; a healthy rank that holds the GIL on an oversubscribed CPU is only reported.
Real processes, real gloo, real pulses; bit-identical to the fault-free run."""

import os
import subprocess
import sys

import pytest

from .localjob import INJECT_AFTER, assert_same_training, final_state

pytestmark = pytest.mark.timeout(240)

FAULT_AT = INJECT_AFTER + 3


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def test_a_rank_blocked_on_a_lock_is_found_by_its_progress_and_restarted(job_factory, reference):
    # Short step timeouts keep the test fast; the step time measured on this box may raise them.
    job = job_factory(detect={"progress_soft_s": 3, "progress_hard_s": 5},
                      extra_args=("--block-node", "local2", "--fault-at", str(FAULT_AT)))
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][1]
    others = {r["rank"]: r["pid"] for r in st["ranks"] if r["rank"] != 1}
    assert job.wait(200) == 0, job.diag()
    faults = _events(job, "fault_detected")
    assert len(faults) == 1, job.diag()
    fault = faults[0]["fault"]
    why = f"{fault}\n{[e for e in job.events() if not e['kind'].startswith('rank_checkpoint')]}\n{job.diag()}"
    assert fault["kind"] == "process_hung" and fault["rank"] == 1, why
    assert "no progress for" in fault["detail"] and "not waiting on its peers" in fault["detail"], why
    # its heartbeat thread kept beating: the old rule (a stale heartbeat) could not have found it
    assert not [e for e in _events(job, "suspect") if e["rank"] == 1 and "heartbeat stale" in e["evidence"]]
    assert [d["level"] for d in _events(job, "recovery_done")] == ["online"], job.diag()
    final = job.status()
    assert final["ranks"][1]["pid"] != victim["pid"]
    assert {r["rank"]: r["pid"] for r in final["ranks"] if r["rank"] != 1} == others
    assert_same_training(final_state(job), reference)


BUSY = "while True: pass"


def test_a_rank_holding_the_gil_on_a_busy_cpu_is_a_suspect_not_a_fault(job_factory, reference):
    job = job_factory(extra_args=("--gil-node", "local2", "--fault-at", str(FAULT_AT), "--gil-s", "3"))
    st = job.wait_for_step(INJECT_AFTER)
    pids = {r["rank"]: r["pid"] for r in st["ranks"]}
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2 * (os.cpu_count() or 2))]
    try:
        job.wait_for_step(FAULT_AT + 2, timeout_s=150)  # the 3 s hold is over
    finally:
        for p in busy:  # ours, by pid
            p.kill()
            p.wait(timeout=10)
    assert job.wait(200) == 0, job.diag()
    assert not _events(job, "fault_detected") and not _events(job, "recovery_start"), job.diag()
    suspects = [e for e in _events(job, "suspect") if e["rank"] == 1]
    assert suspects and "heartbeat stale" in suspects[0]["evidence"], job.diag()  # the old rule's trigger
    assert [e for e in _events(job, "suspect_cleared") if e["rank"] == 1], job.diag()
    assert {r["rank"]: r["pid"] for r in job.status()["ranks"]} == pids
    assert_same_training(final_state(job), reference)
