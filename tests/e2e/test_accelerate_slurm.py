"""End to end on the real local Slurm: an Accelerate loop with ``Resilience(accelerator)``.

``slurm-resilience run`` (2 nodes x 2 ranks + 1 spare, warm zygotes) of
examples/accelerate_train.py; the node of ranks 2-3 is killed in the second epoch. The
step is relaunched on the spare, the spare's ranks get the newest per-step snapshot
from a survivor (``restore()`` broadcast, then ``accelerator.load_state``), the resumed
epoch skips its completed batches (``skip_first_batches``), and every rank's final
weights equal those of a fault-free run of the same program (torch.equal). No
completed step is redone: the relaunch's first step is the one after the restored step.

Preemption: the same job with ``job.preempt_signal: USR1@90`` gets
``scancel --signal=USR1 --batch``; ``step_done()`` stops every rank after the same step,
rank 0 writes it to the job directory, the job is requeued; with the node-local
snapshots removed, the requeued job restores the durable copy and ends bit-identical.
Both cases compare with one fault-free run (module fixture).
"""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from slurm_resilience import lab  # noqa: E402

from . import trainer_jobs as tj  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

STEPS = 16  # 512 samples / (4 ranks x 16) = 8 steps per epoch, 2 epochs


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Path:
    """One fault-free run of the same program, shared by both cases."""
    lab.cluster("reset")
    ref = tmp_path_factory.mktemp("accelerate-ref")
    tj.finish(tj.run(ref, "accelerate_train.py", "accelerate", 0.0), ref)
    return ref


def test_a_lost_node_resumes_on_the_spare_bit_identical_without_redoing_a_step(cluster, reference, tmp_path):
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    proc = tj.run(faulty, "accelerate_train.py", "accelerate", 0.4)
    first = faulty / "job" / "progress-000.log"
    tj.wait_step(proc, first, 10)  # epoch 2, batch 2 done
    victim = json.loads((faulty / "job" / "status.json").read_text())["nodes"][1]
    lab.kill_node(victim)
    output = tj.finish(proc, faulty)

    before, after = tj.steps(first), tj.steps(faulty / "job" / "progress-001.log")
    restored = [int(s) for s in re.findall(r"restored step (\d+) from rank", output)]
    assert len(restored) == 1, output[-6000:]
    assert restored[0] >= before[-1] and restored[0] < STEPS
    assert after == list(range(restored[0] + 1, STEPS + 1))  # nothing redone, nothing skipped
    differ = tj.differ(reference, faulty)
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"


def test_sigusr1_preemption_persists_the_last_step_requeues_and_ends_bit_identical(cluster, reference, tmp_path):
    local = tmp_path / "node-local"  # the nodes' snapshots (SR_ACCELERATE_DIR), removed before the requeue runs
    proc = tj.run(tmp_path, "accelerate_train.py", "accelerate", 0.3, config_extra="job:\n  preempt_signal: USR1@90\n", env={"SR_ACCELERATE_DIR": str(local)})
    job = tmp_path / "job"
    progress = job / "progress-000.log"
    tj.wait_step(proc, progress, 9)
    job_id = json.loads((job / "status.json").read_text())["job_id"]
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    deadline = time.time() + 60
    while not any(e["kind"] == "requeue" for e in tj.events(job)):  # the step has exited by then
        assert proc.poll() is None and time.time() < deadline, "no requeue within 60 s of SIGUSR1"
        time.sleep(0.05)
    before = tj.steps(progress)  # the preempted run's steps (the requeued run starts this file anew)
    shutil.rmtree(local)
    output = tj.finish(proc, tmp_path)

    persisted = [int(s) for s in re.findall(r"preempted: step (\d+) persisted", output)]
    restored = re.findall(r"restored step (\d+) from (the job directory|rank \d+'s node)", output)
    assert persisted == [before[-1]], output[-6000:]  # no completed step lost
    assert "the step exited by itself" in output, output[-6000:]  # not cancelled after the persist wait
    assert restored == [(str(before[-1]), "the job directory")], output[-6000:]
    assert before[-1] < STEPS and tj.steps(progress) == list(range(before[-1] + 1, STEPS + 1))
    differ = tj.differ(reference, tmp_path)
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"
