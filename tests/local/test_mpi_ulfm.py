"""ULFM repairs on this host (tier 3): mpirun --with-ft ulfm over TCP, injected kills.

Every run is examples/mpi_ulfm_train.py (4 active ranks) under the bundled Open MPI 5;
its final state must equal the fault-free run's (or, after a scale-in, a fresh
3-rank run's from the same step) bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from slurm_resilience.mpi.launch import DEFAULT_VENV

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mpi_ulfm_train.py"
VENV = os.environ.get("SR_ULFM_VENV", DEFAULT_VENV)
STEPS = 30
pytestmark = pytest.mark.timeout(120)

if not os.access(os.path.join(VENV, "bin", "mpirun"), os.X_OK):
    pytest.fail(f"no ULFM Open MPI in {VENV}: run scripts/install-deps.sh", pytrace=False)


def mpirun(n: int, out: Path, *args: str, ulfm: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(REPO))
    argv = [os.path.join(VENV, "bin", "mpirun"), *(["--with-ft", "ulfm"] if ulfm else []),
            "--oversubscribe", "-n", str(n), "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", "lo", os.path.join(VENV, "bin", "python"), str(EXAMPLE),
            "--steps", str(STEPS), "--out", str(out), "--events", str(out.parent / "ev"), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=90)


def same(a: Path, b: Path) -> None:
    x, y = np.load(a), np.load(b)
    for k in x.files:
        assert x[k].tobytes() == y[k].tobytes(), f"{k} differs"


def repairs(out: Path) -> list[dict]:
    recs = []
    for f in (out.parent / "ev").glob("events-w*.jsonl"):
        recs += [json.loads(ln) for ln in f.read_text().splitlines()]
    return [r for r in recs if r["kind"] == "repaired"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "final.npz"
    proc = mpirun(4, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_two_failures_each_taken_by_a_spare(tmp_path, reference):
    out = tmp_path / "final.npz"
    proc = mpirun(6, out, "--spares", "2", "--die", "2:8", "--die", "1:17")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    same(reference, out)
    by_wid0 = [r for r in repairs(out) if r["wid"] == 0]
    assert [r["promoted"] for r in by_wid0] == [{"4": 2}, {"5": 1}]


def test_a_failure_during_the_repair_restarts_it(tmp_path, reference):
    out = tmp_path / "final.npz"
    proc = mpirun(6, out, "--spares", "2", "--die", "2:8", "--die-in-repair", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    same(reference, out)
    recs = repairs(out)
    # rank 0 died after Shrink and the gather: the Agree failed, the repair started
    # again from the smaller world and both spares took a lost rank
    assert all(r["lost"] == [0, 2] and r["attempts"] == 2 and r["size"] == 4 for r in recs)
    assert len(recs) == 4


def test_no_spare_left_scales_in_and_equals_a_fresh_3_rank_run(tmp_path):
    out = tmp_path / "final.npz"
    proc = mpirun(4, out, "--die", "2:10", "--dump-at", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {r["size"] for r in repairs(out)} == {3}
    fresh = tmp_path / "fresh" / "final.npz"
    fresh.parent.mkdir()
    proc = mpirun(3, fresh, "--init", f"{out}.step10.npz")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    same(fresh, out)


def test_without_ulfm_enabled_the_session_says_so_in_one_line(tmp_path):
    proc = mpirun(1, tmp_path / "final.npz", ulfm=False)
    assert proc.returncode != 0
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("mpi_ulfm_train:")]
    assert line and "--with-ft ulfm" in line[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_spare_left_parked_after_a_repair_is_released_at_the_end(tmp_path, reference):
    """Two spares, one failure: the spare left parked is addressed by its rank in the
    shrunk world (wid 5 is rank 4 there once wid 2 is gone), not its first world rank."""
    out = tmp_path / "final.npz"
    proc = mpirun(6, out, "--spares", "2", "--die", "2:8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    same(reference, out)
    assert [r["promoted"] for r in repairs(out) if r["wid"] == 0] == [{"4": 2}]
    recs = []
    for f in (out.parent / "ev").glob("events-w*.jsonl"):
        recs += [json.loads(ln) for ln in f.read_text().splitlines()]
    assert {r["wid"]: r["rank"] for r in recs if r["kind"] == "done"}[5] == -1
