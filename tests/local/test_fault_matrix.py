"""Fault matrix on localhost (real processes, real gloo, real files; no Slurm).

Each case runs a real training job, injects one or more faults, and checks that
the job finishes with weights bit-identical to the fault-free run (world size
unchanged), that no committed checkpoint is lost or corrupted, and that the MTTR
of each recovery is recorded. The Slurm-specific faults (node kill through slurmd,
preemption signal, requeue) are in tests/e2e.
"""

import os
import signal
import time

import pytest

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.inject import corrupt_newest

from slurm_resilience.supervisor.decide.decide import EXIT_REQUEUED

from .localjob import INJECT_AFTER, STEPS, LocalJob, assert_same_training, final_state

pytestmark = pytest.mark.timeout(240)


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def _wait_event(job, kind, timeout_s=60.0):
    """Block until the job's log holds an event of ``kind`` (an event, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not ((job.job_dir / "events.jsonl").exists() and _events(job, kind)):
        assert time.monotonic() < deadline, f"no {kind} within {timeout_s}s\n{job.diag()}"
        time.sleep(0.005)
    return _events(job, kind)[0]


def _assert_recorded(job, n):
    done = _events(job, "recovery_done")
    assert len(done) >= n, job.diag()
    assert all(d["detect_to_step_s"] > 0 for d in done)
    return done


def _assert_checkpoints_valid(job):
    root = job.job_dir / "checkpoints"
    for step in mf.complete_steps(str(root)):
        assert mf.validate_step(str(root), step, deep=True) == [], step


def test_two_nodes_lost_at_once(job_factory, reference):
    job = job_factory(spares=2)
    st = job.wait_for_step(INJECT_AFTER)
    job.launcher.fail_node(st["ranks"][0]["node"])
    job.launcher.fail_node(st["ranks"][2]["node"])
    assert job.wait() == 0, job.diag()
    _assert_recorded(job, 1)
    assert sorted(_events(job, "plan")[-1]["nodes"]) == sorted(["local2", "local4", "local5"])
    assert_same_training(final_state(job), reference)
    _assert_checkpoints_valid(job)


def test_fault_during_recovery_the_joining_spare_dies(job_factory, reference):
    job = job_factory(spares=2)
    st = job.wait_for_step(INJECT_AFTER)
    spare_pid = next(s["pid"] for s in st["spares"] if s["node"] == "local4")
    job.launcher.fail_node(st["ranks"][1]["node"])
    _wait_event(job, "recovery_start")  # the spare is adopting rank 1 right now
    try:
        os.kill(spare_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert job.wait() == 0, job.diag()
    assert_same_training(final_state(job), reference)
    # the spare's node is healthy, so the dead joiner is restarted there in place
    levels = [e["level"] for e in _events(job, "ladder")]
    assert levels[0] == "node-replacement" and "online" in levels[1:], levels
    assert _events(job, "plan")[-1]["nodes"][1] == "local4"


def test_loss_of_a_spare_then_a_node(job_factory, reference):
    job = job_factory(spares=2)
    st = job.wait_for_step(INJECT_AFTER)
    os.kill(st["spares"][0]["pid"], signal.SIGKILL)
    _wait_event(job, "fault_detected")  # the spare's loss is seen before the node is lost
    job.launcher.fail_node(st["ranks"][1]["node"])
    assert job.wait() == 0, job.diag()
    spare_faults = [e for e in _events(job, "fault_detected") if e["fault"]["rank"] is None]
    assert spare_faults, job.diag()
    assert _events(job, "plan")[-1]["nodes"][1] == st["spares"][1]["node"]
    assert_same_training(final_state(job), reference)


def test_hung_rank_is_replaced(job_factory, reference):
    job = job_factory()
    st = job.wait_for_step(INJECT_AFTER)
    os.kill(st["ranks"][2]["pid"], signal.SIGSTOP)
    assert job.wait() == 0, job.diag()
    assert _events(job, "fault_detected")[0]["fault"]["kind"] == "process_hung"
    assert_same_training(final_state(job), reference)


def test_corrupt_checkpoint_while_running_is_detected_at_restore(job_factory, reference):
    """Corrupt the copy the restore reads first (rank 0's own L1 shard of the newest step:
    rank 0 is the source when it offers the newest step), then force a relaunch that
    restores from disk: rank 0 must report the shard invalid and restore elsewhere."""
    job = job_factory(checkpoint={"shared_every_kth": 1}, recovery={"online_timeout_s": 0.005})
    st = job.wait_for_step(INJECT_AFTER)
    local0 = job.job_dir.parent / "local" / st["ranks"][0]["node"] / "ckpt"
    deadline = time.monotonic() + 90
    while not mf.complete_steps(str(local0)):  # rank 0's first L1 checkpoint (step 10) is complete
        assert time.monotonic() < deadline, job.diag()
        time.sleep(0.05)
    # the last rank's node dies first: nobody completes another step (no newer checkpoint),
    # and the relaunch (seconds: new processes import torch) starts after the corruption
    job.launcher.fail_node(job.status()["ranks"][-1]["node"])
    bad = corrupt_newest(str(local0))
    assert job.wait() == 0, job.diag()
    assert [d["level"] for d in _events(job, "recovery_done")] == ["process-restart"]
    invalid = [e for e in _events(job, "rank_checkpoint_invalid") if e["path"] == bad["shard"]]
    assert invalid and invalid[0]["step"] == bad["step"] and invalid[0]["source"] == "L1", job.diag()
    # the source restored the corrupted step from an intact copy (partner, L2 or a peer's L1)
    restored = [e for e in _events(job, "rank_restored") if e.get("tier") and e["step"] == bad["step"]]
    assert restored and restored[0]["tier"] != "L0", _events(job, "rank_restored")
    assert_same_training(final_state(job), reference)


def test_full_disk_fails_checkpoints_not_training(job_factory, reference, tmp_path):
    import subprocess

    disk = tmp_path / "tiny"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        job = job_factory(checkpoint={"shared_dir": str(disk / "l2"), "shared_every_kth": 1})
        assert job.wait() == 0, job.diag()
        failed = _events(job, "rank_checkpoint_failed")
        assert failed and all("\n" not in e["error"] for e in failed)
        assert_same_training(final_state(job), reference)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_preemption_signal_to_one_rank_persists_one_step_and_a_rerun_resumes_exactly(tmp_path, reference):
    """The submitit form of preemption (the signal reaches the steps): the rank asks,
    the supervisor publishes a PERSIST generation, every rank persists the same step;
    without a scheduler the job exits 'requeued' and a rerun resumes at that step."""
    job = LocalJob(tmp_path, job_name="job").start()
    try:
        st = job.wait_for_step(INJECT_AFTER)
        os.kill(st["ranks"][1]["pid"], signal.SIGUSR2)
        assert job.wait() == EXIT_REQUEUED, job.diag()
    finally:
        job.kill_leftovers()
    persisted = _events(job, "rank_persisted")
    assert len(persisted) == 3 and len({e["step"] for e in persisted}) == 1, persisted
    assert all(e["committed"] for e in persisted), persisted
    step = persisted[0]["step"]
    assert INJECT_AFTER <= step < STEPS
    rerun = LocalJob(tmp_path, job_name="job").start()
    try:
        assert rerun.wait() == 0, rerun.diag()
    finally:
        rerun.kill_leftovers()
    restored = [e for e in _events(rerun, "rank_restored") if e.get("tier")]  # the log is appended
    assert restored[-1]["step"] == step and restored[-1]["offers"] == [step] * 3, restored[-1]
    assert_same_training(final_state(rerun), reference)
