"""Shared by the Trainer e2e tests (Lightning, Accelerate): run an example under
``slurm-resilience run`` (2 nodes x 2 ranks + 1 spare, warm zygotes), wait on its
progress file, finish or cancel it, and compare every rank's final weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from slurm_resilience import lab

ENV = {"GLOO_SOCKET_IFNAME": "lo"}
RANKS = 4


def run(root: Path, script: str, preload: str, step_time: float, config_extra: str = "",
        env: dict[str, str] | None = None) -> subprocess.Popen:
    """``examples/{script}`` under ``run``, its zygotes preloading ``preload``."""
    config = root / "config.yaml"
    config.write_text(f"run:\n  preload: [{preload}]\n" + config_extra)
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--nodes", "2", "--spares", "1",
            "--tasks-per-node", "2", "--job-dir", str(root / "job"), "--config", str(config),
            "--", sys.executable, str(lab.REPO / "examples" / script), "--epochs", "2", "--batch", "16",
            "--step-time", str(step_time), "--out", str(root / "final-{rank}.pt")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV, **(env or {})})


def cancel(proc: subprocess.Popen, root: Path) -> None:
    """A run that timed out: end its client and cancel its job (found by its script's path),
    so that no job of this test stays queued in the shared lab."""
    proc.kill()
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True, timeout=30).stdout
    for line in jobs.splitlines():
        job_id, _, command = line.partition(" ")
        if command.startswith(str(root / "job") + "/"):
            subprocess.run(["scancel", job_id], timeout=30)


def finish(proc: subprocess.Popen, root: Path) -> str:
    """Wait for the run (it must exit 0); its output and the job's logs."""
    try:
        code = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        cancel(proc, root)
        raise
    logs = "".join(p.read_text() for p in sorted((root / "job").glob("*.log")))
    output = proc.stdout.read() + logs
    assert code == 0, output[-6000:]
    return output


def steps(path: Path) -> list[int]:
    """The steps a progress file lists (empty before it exists)."""
    return [int(line.split()[0]) for line in path.read_text().splitlines()] if path.exists() else []


def wait_step(proc: subprocess.Popen, progress: Path, step: int) -> None:
    deadline = time.time() + 120
    while not steps(progress) or steps(progress)[-1] < step:
        assert proc.poll() is None and time.time() < deadline, f"no step {step} within 120 s"
        time.sleep(0.05)


def differ(ref: Path, run_dir: Path) -> list[int]:
    """Ranks whose final weights differ from the fault-free run's (torch.equal)."""
    out = []
    for r in range(RANKS):
        a, b = torch.load(ref / f"final-{r}.pt"), torch.load(run_dir / f"final-{r}.pt")
        assert a.keys() == b.keys()
        out += [r] if not all(torch.equal(a[k], b[k]) for k in a) else []
    return out


def events(job: Path) -> list[dict]:
    path = job / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
