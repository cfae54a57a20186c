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
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from slurm_resilience import lab  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

ENV = {"GLOO_SOCKET_IFNAME": "lo"}
RANKS = 4
STEPS = 16  # 512 samples / (4 ranks x 16) = 8 steps per epoch, 2 epochs


def _run(root: Path, step_time: float, config_extra: str = "", env: dict[str, str] | None = None) -> subprocess.Popen:
    config = root / "config.yaml"
    config.write_text("run:\n  preload: [accelerate]\n" + config_extra)
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--nodes", "2", "--spares", "1",
            "--tasks-per-node", "2", "--job-dir", str(root / "job"), "--config", str(config),
            "--", sys.executable, str(lab.REPO / "examples" / "accelerate_train.py"), "--epochs", "2",
            "--batch", "16", "--step-time", str(step_time), "--out", str(root / "final-{rank}.pt")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV, **(env or {})})


def _cancel(proc: subprocess.Popen, root: Path) -> None:
    """A run that timed out: end its client and cancel its job (found by its script's path),
    so that no job of this test stays queued in the shared lab."""
    proc.kill()
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True, timeout=30).stdout
    for line in jobs.splitlines():
        job_id, _, command = line.partition(" ")
        if command.startswith(str(root / "job") + "/"):
            subprocess.run(["scancel", job_id], timeout=30)


def _finish(proc: subprocess.Popen, root: Path) -> str:
    try:
        code = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        _cancel(proc, root)
        raise
    logs = "".join(p.read_text() for p in sorted((root / "job").glob("*.log")))
    output = proc.stdout.read() + logs
    assert code == 0, output[-6000:]
    return output


def _steps(path: Path) -> list[int]:
    return [int(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_step(proc: subprocess.Popen, progress: Path, step: int) -> None:
    deadline = time.time() + 120
    while not _steps(progress) or _steps(progress)[-1] < step:
        assert proc.poll() is None and time.time() < deadline, f"no step {step} within 120 s"
        time.sleep(0.05)


def _differ(ref: Path, run: Path) -> list[int]:
    """Ranks whose final weights differ from the fault-free run's (torch.equal)."""
    differ = []
    for r in range(RANKS):
        a, b = torch.load(ref / f"final-{r}.pt"), torch.load(run / f"final-{r}.pt")
        assert a.keys() == b.keys()
        differ += [r] if not all(torch.equal(a[k], b[k]) for k in a) else []
    return differ


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> Path:
    """One fault-free run of the same program, shared by both cases."""
    lab.cluster("reset")
    ref = tmp_path_factory.mktemp("accelerate-ref")
    _finish(_run(ref, 0.0), ref)
    return ref


def test_a_lost_node_resumes_on_the_spare_bit_identical_without_redoing_a_step(cluster, reference, tmp_path):
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    proc = _run(faulty, 0.4)
    first = faulty / "job" / "progress-000.log"
    _wait_step(proc, first, 10)  # epoch 2, batch 2 done
    victim = json.loads((faulty / "job" / "status.json").read_text())["nodes"][1]
    lab.kill_node(victim)
    output = _finish(proc, faulty)

    before, after = _steps(first), _steps(faulty / "job" / "progress-001.log")
    restored = [int(s) for s in re.findall(r"restored step (\d+) from rank", output)]
    assert len(restored) == 1, output[-6000:]
    assert restored[0] >= before[-1] and restored[0] < STEPS
    assert after == list(range(restored[0] + 1, STEPS + 1))  # nothing redone, nothing skipped
    differ = _differ(reference, faulty)
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"


def _events(job: Path) -> list[dict]:
    path = job / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_sigusr1_preemption_persists_the_last_step_requeues_and_ends_bit_identical(cluster, reference, tmp_path):
    local = tmp_path / "node-local"  # the nodes' snapshots (SR_ACCELERATE_DIR), removed before the requeue runs
    proc = _run(tmp_path, 0.3, config_extra="job:\n  preempt_signal: USR1@90\n", env={"SR_ACCELERATE_DIR": str(local)})
    job = tmp_path / "job"
    progress = job / "progress-000.log"
    _wait_step(proc, progress, 9)
    job_id = json.loads((job / "status.json").read_text())["job_id"]
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    deadline = time.time() + 60
    while not any(e["kind"] == "requeue" for e in _events(job)):  # the step has exited by then
        assert proc.poll() is None and time.time() < deadline, "no requeue within 60 s of SIGUSR1"
        time.sleep(0.05)
    before = _steps(progress)  # the preempted run's steps (the requeued run starts this file anew)
    shutil.rmtree(local)
    output = _finish(proc, tmp_path)

    persisted = [int(s) for s in re.findall(r"preempted: step (\d+) persisted", output)]
    restored = re.findall(r"restored step (\d+) from (the job directory|rank \d+'s node)", output)
    assert persisted == [before[-1]], output[-6000:]  # no completed step lost
    assert restored == [(str(before[-1]), "the job directory")], output[-6000:]
    assert before[-1] < STEPS and _steps(progress) == list(range(before[-1] + 1, STEPS + 1))
    differ = _differ(reference, tmp_path)
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"
