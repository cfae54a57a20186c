"""An mpi4py job repaired in place (ULFM) on the local Slurm cluster.

One batch job of 6 nodes under ``--no-kill``: the batch host runs the bundled
``mpirun --with-ft ulfm`` (``python -m slurm_resilience.mpi.launch``), 4 active ranks
on 4 nodes, 1 spare rank on a fifth. The rank on a worker node is SIGKILLed mid-run:
the spare takes its number in place, no process is started, and the final state
equals a fault-free run's bit for bit (the fault-free run is one mpirun on this
host, shared by the module).

A node *kill* (its PRRTE daemon lost with it) is not repaired in place: PRRTE 3.0.11
aborts the whole job when it loses a daemon (docs/mpi-ulfm.md).
"""

from __future__ import annotations

import json
import os
import signal
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Fault-free: 4 active ranks + 1 spare on this host (same sums, rank order)."""
    out = tmp_path_factory.mktemp("ulfm-ref") / "final.npz"
    argv = [os.path.join(VENV, "bin", "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", "5",
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
            PYTHON, str(EXAMPLE), "--spares", "1", "--steps", str(STEPS), "--out", str(out)]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


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


def _last_step(progress: Path) -> int:
    try:
        lines = progress.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return int(lines[-1].split()[0]) if lines else -1


def test_rank_lost_on_a_node_is_replaced_in_place_by_the_spare(cluster, tmp_path, reference):
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    ev, progress, out = job / "ev", job / "progress", job / "final.npz"
    program = [PYTHON, str(EXAMPLE), "--spares", "1", "--steps", str(STEPS), "--step-time", "0.1",
               "--out", str(out), "--events", str(ev), "--progress", str(progress)]
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
        _wait(lambda: _last_step(progress) >= 10, 90, "step 10")
        starts = {r["wid"]: r for r in _events(ev) if r["kind"] == "start"}
        assert len(starts) == 5 and starts[4]["rank"] == -1
        victim = starts[2]
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        _wait(lambda: out.exists(), 60, "the final state")
        _wait(lambda: sum(r["kind"] == "exit" for r in _events(ev)) == 4, 20, "four exits")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    recs = _events(ev)
    assert len([r for r in recs if r["kind"] == "start"]) == 5  # nothing started again
    repaired = [r for r in recs if r["kind"] == "repaired"]
    assert {r["wid"] for r in repaired} == {0, 1, 3, 4}
    assert all(r["promoted"] == {"4": 2} and r["lost"] == [2] for r in repaired)
    exits = {r["wid"]: r for r in recs if r["kind"] == "exit"}
    assert exits[4]["rank"] == 2 and starts[4]["node"] != victim["node"]
    assert {w: starts[w]["pid"] for w in exits} == {w: starts[w]["pid"] for w in (0, 1, 3, 4)}
    first = min(r["t"] for r in recs if r["kind"] == "first_step")
    print(f"\nULFM repair: {max(r['ms'] for r in repaired):.0f} ms; kill -> first step "
          f"{first - t_kill:.3f} s")
    a, b = np.load(reference), np.load(out)
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs from the fault-free run"
