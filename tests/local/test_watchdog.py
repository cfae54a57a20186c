"""Tier 3, the step-progress watchdog (supervisor/observe/watchdog.py, worker/pulse.py): a rank
whose main thread is stuck while its process and heartbeat thread live on is found (by
the blocking timeout: every other rank waits on it) and recovered; a healthy rank that
holds the GIL for 3 s on an oversubscribed CPU is only reported (the same defaults).
Real processes, real gloo, real pulses; bit-identical to the fault-free run."""

import os
import subprocess
import sys
import time

import pytest

from .localjob import INJECT_AFTER, assert_same_training, final_state

pytestmark = pytest.mark.timeout(240)

FAULT_AT = INJECT_AFTER + 3


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def test_a_rank_blocked_on_a_lock_is_found_by_its_waiting_peers_and_restarted(job_factory, reference, tmp_path):
    # The defaults: the job blocked on one rank is found after the blocking timeout (5 s:
    # 2.5 x heartbeat_timeout_s), not the hard one (20 s); benchmarks/hang_detect.py times both.
    flag = tmp_path / "block"
    job = job_factory(extra_args=("--block-file", str(flag)))
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][1]
    others = {r["rank"]: r["pid"] for r in st["ranks"] if r["rank"] != 1}
    flag.with_suffix(".tmp").write_text(victim["worker_id"])
    t_fault = time.time()
    os.replace(flag.with_suffix(".tmp"), flag)  # its next step blocks on a lock forever
    assert job.wait(200) == 0, job.diag()
    faults = _events(job, "fault_detected")
    assert len(faults) == 1, job.diag()
    fault = faults[0]["fault"]
    why = f"{fault}\n{[e for e in job.events() if not e['kind'].startswith('rank_checkpoint')]}\n{job.diag()}"
    assert fault["kind"] == "process_hung" and fault["rank"] == 1, why
    # the rule: no progress past the blocking timeout while every other rank waits on it
    assert "no progress for" in fault["detail"] and "blocking timeout" in fault["detail"], why
    assert "while every other rank waits on its peers (state" in fault["detail"], why  # seen by its pulse
    # its heartbeat thread kept beating: the old rule (a stale heartbeat) could not have found it
    assert not [e for e in _events(job, "suspect") if e["rank"] == 1 and "heartbeat stale" in e["evidence"]]
    assert [d["level"] for d in _events(job, "recovery_done")] == ["online"], job.diag()
    print(f"lock-blocked rank: fault -> detected {faults[0]['t'] - t_fault:.2f} s, "
          f"-> recovery start {_events(job, 'recovery_start')[0]['t'] - t_fault:.2f} s")
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
