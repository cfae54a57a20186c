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
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from slurm_resilience import lab  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

ENV = {"GLOO_SOCKET_IFNAME": "lo"}
RANKS = 4
STEPS = 16  # 512 samples / (4 ranks x 16) = 8 steps per epoch, 2 epochs


def _run(root: Path, script: str, step_time: float) -> subprocess.Popen:
    config = root / "config.yaml"
    config.write_text("run:\n  preload: [pytorch_lightning]\n")
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--nodes", "2", "--spares", "1",
            "--tasks-per-node", "2", "--job-dir", str(root / "job"), "--config", str(config),
            "--", sys.executable, str(lab.REPO / "examples" / script), "--epochs", "2", "--batch", "16",
            "--step-time", str(step_time), "--out", str(root / "final-{rank}.pt")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV})


def _finish(proc: subprocess.Popen, root: Path) -> str:
    code = proc.wait(timeout=180)
    logs = "".join(p.read_text() for p in sorted((root / "job").glob("*.log")))
    output = proc.stdout.read() + logs
    assert code == 0, output[-6000:]
    return output


def _steps(path: Path) -> list[int]:
    return [int(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []


def _states(root: Path) -> list[dict]:
    return [torch.load(root / f"final-{r}.pt") for r in range(RANKS)]


def test_a_lost_node_resumes_on_the_spare_bit_identical_without_redoing_a_step(cluster, tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    _finish(_run(ref, "lightning_train.py", 0.0), ref)  # the same program, no fault

    lab.cluster("reset")
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    proc = _run(faulty, "lightning_train.py", 0.4)
    first = faulty / "job" / "progress-000.log"
    deadline = time.time() + 120
    while not _steps(first) or _steps(first)[-1] < 10:  # epoch 2, batch 2 done
        assert proc.poll() is None and time.time() < deadline, "no step 10 within 120 s"
        time.sleep(0.05)
    import json

    victim = json.loads((faulty / "job" / "status.json").read_text())["nodes"][1]
    lab.kill_node(victim)
    output = _finish(proc, faulty)

    before, after = _steps(first), _steps(faulty / "job" / "progress-001.log")
    restored = [int(s) for s in re.findall(r"restored step (\d+) from rank", output)]
    assert len(restored) == 1, output[-6000:]
    assert restored[0] >= before[-1] and restored[0] < STEPS
    assert after == list(range(restored[0] + 1, STEPS + 1))  # nothing redone, nothing skipped
    differ = []
    for r, (a, b) in enumerate(zip(_states(ref), _states(faulty))):
        assert a.keys() == b.keys()
        differ += [r] if not all(torch.equal(a[k], b[k]) for k in a) else []
    assert not differ, f"ranks {differ}: final weights differ from the fault-free run (torch.equal)"
