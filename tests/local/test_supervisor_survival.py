"""kill-supervisor without Slurm: `slurm-resilience local` runs the same keeper as the
batch step; a SIGKILLed supervisor is restarted and re-attaches to the running ranks."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

from .localjob import TRAIN

pytestmark = pytest.mark.timeout(180)
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "local-cluster.yaml"


def _status(job_dir: Path) -> dict | None:
    return lab.JobRun(job_dir=job_dir, process=None).status


def _wait(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _events(job_dir: Path, kind: str) -> list[dict]:
    path = job_dir / "events.jsonl"
    return [e for e in read_events(str(path)) if e["kind"] == kind] if path.exists() else []


def test_killed_supervisor_reattaches_and_still_recovers_a_killed_rank(tmp_path):
    job_dir = tmp_path / "job"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.read_text().replace("/tmp/slurm_resilience-{user}/{job_id}", str(tmp_path / "local")))
    keeper = subprocess.Popen(
        [sys.executable, "-m", "slurm_resilience.cli", "local", "--config", str(cfg), "--nodes", "3",
         "--spares", "1", "--job-dir", str(job_dir), "--", sys.executable, str(TRAIN), "--steps", "160",
         "--step-time", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        st = _wait(lambda: (s := _status(job_dir)) and all(r["pid"] and r["step"] >= 5 for r in s["ranks"]) and s,
                   "step 5")
        pids = [r["pid"] for r in st["ranks"]]
        os.kill(st["supervisor_pid"], signal.SIGKILL)
        _wait(lambda: _events(job_dir, "supervisor_reattached"), "the re-attach")
        st2 = _wait(lambda: (s := _status(job_dir)) and s["supervisor_pid"] != st["supervisor_pid"]
                    and min(r["step"] for r in s["ranks"]) > st["ranks"][0]["step"] + 5 and s, "progress")
        assert [r["pid"] for r in st2["ranks"]] == pids and st2["generation"] == st["generation"]
        os.kill(pids[1], signal.SIGKILL)  # a fault after the re-attach is still seen and recovered
        out, _ = keeper.communicate(timeout=120)
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
    assert keeper.returncode == 0, out
    # every worker it started: 3 ranks, the spare's standby and the worker nodes' own standbys
    # (recovery.local_standbys) started before the kill
    taken = _events(job_dir, "supervisor_reattached")[0]["workers"]
    assert {"local1.1", "local2.2", "local3.3", "local4.4"} <= set(taken), taken
    assert "killed by signal 9" in out and f"re-attached to {len(taken)} running worker(s)" in out
    assert [d["level"] for d in _events(job_dir, "recovery_done")] == ["online"]
    import torch

    assert torch.load(job_dir / "final.pt", weights_only=False)["step"] == 160
