"""End to end on the real local Slurm: a Lightning Trainer with ``Resilience()``.

``slurm-resilience run`` (2 nodes x 2 ranks + 1 spare, warm zygotes) of
examples/lightning_train.py; the node of ranks 2-3 is killed in the second epoch's
middle. The step is relaunched on the spare, the spare's ranks get the newest
per-step snapshot from a survivor (``on_fit_start`` broadcast), the sampler skips
the epoch's completed batches, and every rank's final weights equal those of a
fault-free run of the same program: torch.equal (``Resilience`` fixes DDP's bucket
layout from parameter order, so its last bits differ from the plain twin's, which
re-buckets after its first backward; docs/lightning.md).
No completed step is redone: the relaunch restores the last step the killed
generation reported (or a newer one) and its first step is the next one.

Preemption: the same job with ``job.preempt_signal: USR1@90`` gets SIGUSR1 on its batch
shell (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@90`` sends); the
supervisor asks the step to persist, the ranks stop after the step in flight, rank 0
copies it to the job directory, the job is requeued. The node-local snapshots are removed
before the requeued job starts (a requeue may land on other nodes): it restores the
durable copy, trains exactly the remaining steps and ends bit-identical. Both cases
compare with one fault-free run of the same program (module fixture).
"""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

from slurm_resilience import lab  # noqa: E402

from . import trainer_jobs as tj  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

STEPS = 16  # 512 samples / (4 ranks x 16) = 8 steps per epoch, 2 epochs


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Path:
    """One fault-free run of the same program, shared by both cases."""
    lab.cluster("reset")
    ref = tmp_path_factory.mktemp("lightning-ref")
    tj.finish(tj.run(ref, "lightning_train.py", "pytorch_lightning", 0.0), ref)
    return ref


def test_a_lost_node_resumes_on_the_spare_bit_identical_without_redoing_a_step(cluster, reference, tmp_path):
    ref = reference
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    proc = tj.run(faulty, "lightning_train.py", "pytorch_lightning", 0.4)
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
    differ = tj.differ(ref, faulty)
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"


def test_sigusr1_preemption_persists_the_last_step_requeues_and_ends_bit_identical(cluster, reference, tmp_path):
    local = tmp_path / "node-local"  # the nodes' snapshots (SR_LIGHTNING_DIR), removed before the requeue runs
    proc = tj.run(tmp_path, "lightning_train.py", "pytorch_lightning", 0.3, config_extra="job:\n  preempt_signal: USR1@90\n",
                env={"SR_LIGHTNING_DIR": str(local)})
    job = tmp_path / "job"
    progress = job / "progress-000.log"
    tj.wait_step(proc, progress, 9)
    job_id = json.loads((job / "status.json").read_text())["job_id"]
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    deadline = time.time() + 60
    while not any(e["kind"] == "requeue" for e in tj.events(job)):  # the step has exited by then
        assert proc.poll() is None and time.time() < deadline, "no requeue within 60 s of SIGUSR1"
        time.sleep(0.05)
    before = tj.steps(progress)  # the preempted run's steps (the requeued run starts this file anew)
    shutil.rmtree(local)
    requeued = time.time()
    output = tj.finish(proc, tmp_path)

    persisted = [int(s) for s in re.findall(r"preempted: step (\d+) persisted", output)]
    restored = re.findall(r"restored step (\d+) from (the job directory|rank \d+'s node)", output)
    assert persisted == [before[-1]], output[-6000:]  # no completed step lost
    assert "the step exited by itself" in output, output[-6000:]  # not cancelled after the persist wait
    assert restored == [(str(before[-1]), "the job directory")], output[-6000:]
    assert before[-1] < STEPS and tj.steps(progress) == list(range(before[-1] + 1, STEPS + 1))
    assert subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                          timeout=30).stdout.count("Restarts=1") == 1
    differ = tj.differ(reference, tmp_path)
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"
    print(f"preempted at step {before[-1]}: requeue event {requeued - signalled:.1f} s after SIGUSR1, "
          f"job done {time.time() - requeued:.1f} s later")
