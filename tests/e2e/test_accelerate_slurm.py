"""End to end on the real local Slurm: an Accelerate loop with ``Resilience(accelerator)``.

``slurm-resilience run`` (2 nodes x 2 ranks + 1 spare, warm zygotes) of
examples/accelerate_train.py; the node of ranks 2-3 is killed in the second epoch. The
step is relaunched on the spare, the spare's ranks get the newest per-step snapshot
from a survivor (``restore()`` broadcast, then ``accelerator.load_state``), the resumed
epoch skips its completed batches (``skip_first_batches``), and every rank's final
weights equal those of a fault-free run of the same program (torch.equal). No
completed step is redone: the relaunch's first step is the one after the restored step.
"""

import json
import os
import re
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


def _run(root: Path, step_time: float) -> subprocess.Popen:
    config = root / "config.yaml"
    config.write_text("run:\n  preload: [accelerate]\n")
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--nodes", "2", "--spares", "1",
            "--tasks-per-node", "2", "--job-dir", str(root / "job"), "--config", str(config),
            "--", sys.executable, str(lab.REPO / "examples" / "accelerate_train.py"), "--epochs", "2",
            "--batch", "16", "--step-time", str(step_time), "--out", str(root / "final-{rank}.pt")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV})


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


def test_a_lost_node_resumes_on_the_spare_bit_identical_without_redoing_a_step(cluster, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    _finish(_run(ref, 0.0), ref)  # the same program, no fault

    lab.cluster("reset")
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    proc = _run(faulty, 0.4)
    first = faulty / "job" / "progress-000.log"
    deadline = time.time() + 120
    while not _steps(first) or _steps(first)[-1] < 10:  # epoch 2, batch 2 done
        assert proc.poll() is None and time.time() < deadline, "no step 10 within 120 s"
        time.sleep(0.05)
    victim = json.loads((faulty / "job" / "status.json").read_text())["nodes"][1]
    lab.kill_node(victim)
    output = _finish(proc, faulty)

    before, after = _steps(first), _steps(faulty / "job" / "progress-001.log")
    restored = [int(s) for s in re.findall(r"restored step (\d+) from rank", output)]
    assert len(restored) == 1, output[-6000:]
    assert restored[0] >= before[-1] and restored[0] < STEPS
    assert after == list(range(restored[0] + 1, STEPS + 1))  # nothing redone, nothing skipped
    differ = []
    for r in range(RANKS):
        a, b = torch.load(ref / f"final-{r}.pt"), torch.load(faulty / f"final-{r}.pt")
        assert a.keys() == b.keys()
        differ += [r] if not all(torch.equal(a[k], b[k]) for k in a) else []
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"
