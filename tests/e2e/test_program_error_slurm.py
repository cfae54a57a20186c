"""Issue 22 end to end: a program's own bug fails the job once and drains no node.

Two short jobs (2 nodes + 1 spare) on the real local Slurm: one whose program raises
at its first state sync on every rank, one whose rank 1 raises at step 3 in every
generation. Each must end with exit 3 after at most one recovery, the program's error
(and its traceback) in ``slurm-resilience status`` and the supervisor log, no requeue,
and every node of the lab still in service.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

PROGRAM = Path(__file__).with_name("buggy_program.py")


def _kinds(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


def _node_states() -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, check=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def _status(job_dir) -> str:
    return subprocess.run([sys.executable, "-m", "slurm_resilience.cli", "status", str(job_dir)],
                          capture_output=True, text=True).stdout


def _fails_once(run, headline: str) -> None:
    code = run.wait()
    out = run.output()
    assert code == 3, out
    errors = [line for line in out.splitlines() if line.startswith("slurm-resilience: error:")]
    assert len(errors) == 1 and "the program failed: " + headline in errors[0], out
    assert "no node isolated" in errors[0]
    log = (run.job_dir / "supervisor.log").read_text()
    assert "  | Traceback (most recent call last):" in log and "  | " + headline in log, log
    status = _status(run.job_dir)
    assert "failed: the program failed: " + headline in status and "  | " + headline in status, status
    assert "isolated nodes" not in status
    assert not _kinds(run.job_dir, "isolated") and not _kinds(run.job_dir, "requeue")
    failed = _kinds(run.job_dir, "job_failed")
    assert len(failed) == 1 and failed[0]["program_error"]["traceback"][-1] == headline
    bad = {n: s for n, s in _node_states().items() if not s.startswith(("idle", "mixed", "allocated", "completing"))}
    assert not bad, f"nodes out of service after a program error: {bad}"


def test_a_program_raising_at_its_first_state_sync_fails_once(cluster, jobs_root):
    run = lab.submit(jobs_root / "bug-sync", nodes=2, spares=1, steps=10, script=PROGRAM,
                     extra_args=["--broken-state"])
    _fails_once(run, 'RuntimeError: Error(s) in loading state_dict for Linear: Missing key(s) in state_dict: "0.weight"')
    failed = _kinds(run.job_dir, "job_failed")[0]
    assert failed["program_error"]["phase"] == "state_sync" and len(failed["ranks"]) == 2
    assert json.loads((run.job_dir / "status.json").read_text())["recoveries"] <= 1


def test_a_program_raising_at_the_same_step_after_a_recovery_fails_once(cluster, jobs_root):
    run = lab.submit(jobs_root / "bug-step", nodes=2, spares=1, steps=12, script=PROGRAM,
                     extra_args=["--raise-at", "3"])
    _fails_once(run, "ValueError: bad sample at step 3: label out of range")
    failed = _kinds(run.job_dir, "job_failed")[0]
    assert failed["program_error"]["step"] == 3 and failed["program_error"]["phase"] == "step"
    assert "the same error at the same point (step 3, step) after recovery 1" in failed["reason"]
    assert [e["level"] for e in _kinds(run.job_dir, "recovery_start")] == ["online"]
