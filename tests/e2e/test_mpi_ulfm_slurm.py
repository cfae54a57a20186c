"""An mpi4py job repaired in place (ULFM) on the local Slurm cluster.

One batch job of 6 nodes under ``--no-kill``: the batch host runs the bundled
``mpirun --with-ft ulfm`` (``python -m slurm_resilience.mpi.launch``), 4 active ranks
on 4 nodes, 1 spare rank on a fifth. A rank dies mid-run and another in the repair;
the repair starts again, the spare takes one lost number and the job scales in to 3
ranks for the other; no process is started, and the final state equals a fresh
3-rank run from the same step bit for bit (one mpirun on this host).

A node *kill* (its PRRTE daemon lost with it) is not repaired in place: PRRTE 3.0.11
aborts the whole job when it loses a daemon (docs/mpi-ulfm.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from slurm_resilience.mpi.launch import DEFAULT_VENV

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mpi_ulfm_train.py"
VENV = os.environ.get("SR_ULFM_VENV", DEFAULT_VENV)
PYTHON = os.path.join(VENV, "bin", "python")
STEPS = 40
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]

if not os.access(os.path.join(VENV, "bin", "mpirun"), os.X_OK):
    pytest.fail(f"no ULFM Open MPI in {VENV}: run scripts/install-deps.sh", pytrace=False)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = str(REPO)
    return env


def _mpirun_here(n: int, out: Path, *args: str) -> None:
    """A fault-free ULFM run of ``n`` processes on this host (the same sums in rank order)."""
    argv = [os.path.join(VENV, "bin", "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", str(n),
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
            PYTHON, str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), *args]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _events(ev_dir: Path) -> list[dict]:
    recs = []
    for f in sorted(ev_dir.glob("events-w*.jsonl")):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return recs


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_failure_during_the_repair_then_no_spare_left_scales_in_exactly(cluster, tmp_path):
    """World rank 2 dies at step 10 (SIGKILL, on its own node); world rank 0 dies in the
    repair, after Shrink and the gather (``--die-in-repair``): the repair starts again from
    the smaller world, the one spare takes a lost number and, no spare left for the other,
    the job goes on with 3 ranks. No process is started; the final state equals a fresh
    3-rank run from step 10 (data by global sample index) bit for bit. (A rank replaced in
    place by a spare alone: test_mpi_path_slurm.py, G = 2.)"""
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    ev, progress, out = job / "ev", job / "progress", job / "final.npz"
    program = [PYTHON, str(EXAMPLE), "--spares", "1", "--steps", str(STEPS), "--step-time", "0.1",
               "--out", str(out), "--events", str(ev), "--progress", str(progress),
               "--die", "2:10", "--die-in-repair", "0", "--dump-at", "10"]
    launch = [sys.executable, "-m", "slurm_resilience.mpi.launch", "--spare-nodes", "1",
              "--tcp-if", "lo", "--", *program]
    script = job / "job.sbatch"
    script.write_text("#!/bin/bash\nexec " + " ".join(f"'{a}'" for a in launch) + "\n")
    script.chmod(0o700)
    sub = subprocess.run(["sbatch", "--parsable", "-N", "6", "--no-kill", "-t", "3", "-J", "sr-ulfm",
                          "-o", str(job / "out.log"), str(script)],
                         env=_env(), capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    try:
        _wait(lambda: out.exists(), 120, "the final state")
        _wait(lambda: sum(r["kind"] == "exit" for r in _events(ev)) == 3, 20, "three exits")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    recs = _events(ev)
    starts = {r["wid"]: r for r in recs if r["kind"] == "start"}
    assert len(starts) == 5 and starts[4]["rank"] == -1  # nothing started again
    assert len({starts[w]["node"] for w in starts}) == 5  # one process per node
    repaired = [r for r in recs if r["kind"] == "repaired"]
    assert {r["wid"] for r in repaired} == {1, 3, 4}, repaired
    assert all(r["lost"] == [0, 2] and r["attempts"] == 2 and r["size"] == 3 for r in repaired), repaired
    exits = {r["wid"]: r for r in recs if r["kind"] == "exit"}
    assert sorted(exits) == [1, 3, 4] and exits[4]["rank"] != -1  # the spare took a lost number
    assert {w: starts[w]["pid"] for w in exits} == {w: starts[w]["pid"] for w in (1, 3, 4)}
    fresh = tmp_path / "fresh" / "final.npz"
    fresh.parent.mkdir()
    _mpirun_here(3, fresh, "--init", f"{out}.step10.npz")
    a, b = np.load(fresh), np.load(out)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs from a fresh 3-rank run from step 10"
