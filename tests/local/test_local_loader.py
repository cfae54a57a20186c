"""Tier 3: ResumableLoader inside a real Session (LocalLauncher, gloo on lo).

A run with two DataLoader workers per rank and a SIGKILLed rank (online recovery: the
survivors' loaders roll back, the new rank's starts at the restored position) ends
with the same bits as a fault-free run that loads in the main process: the batches,
random augmentation included, depend on (seed, position, rank, world size) only.
"""

import os
import signal
from pathlib import Path

import pytest

from .localjob import INJECT_AFTER, LocalJob, assert_same_training, final_state

SCRIPT = Path(__file__).with_name("train_loader.py")


@pytest.mark.timeout(300)
def test_killed_rank_with_dataloader_workers_matches_a_run_without_workers(tmp_path, job_factory):
    ref = LocalJob(tmp_path / "ref", script=SCRIPT, extra_args=("--workers", "0")).start()
    try:
        assert ref.wait(150) == 0, ref.diag()
    finally:
        ref.kill_leftovers()
    job = job_factory(script=SCRIPT, extra_args=("--workers", "2"))
    victim = job.wait_for_step(INJECT_AFTER)["ranks"][1]
    os.kill(victim["pid"], signal.SIGKILL)  # a rank this job started (its workers follow)
    assert job.wait() == 0, job.diag()
    done = [e for e in job.events() if e["kind"] == "recovery_done"]
    assert done and done[0]["level"] == "online", job.diag()
    assert_same_training(final_state(job), final_state(ref))
