"""One real local Slurm cluster shared by every end-to-end test (session scope).

The cluster is started by ``scripts/local-cluster start`` (scripts/test.sh has
already installed Slurm); each test begins with every node healthy again.
"""

import os
import shutil
from pathlib import Path

import pytest

from slurm_resilience import lab


@pytest.fixture(scope="session")
def slurm_cluster():
    if shutil.which("slurmctld") is None:
        pytest.fail("Slurm is not installed: run scripts/test.sh (it installs and starts everything)")
    lab.cluster("start")
    lab_dir = os.environ.get("SR_LAB", "/tmp/sr-cluster")
    os.environ["SLURM_CONF"] = os.path.join(lab_dir, "etc", "slurm.conf")
    yield lab_dir


@pytest.fixture
def cluster(slurm_cluster):
    """A healthy cluster for this test: nodes killed by earlier tests are revived."""
    lab.cluster("reset")
    return slurm_cluster


@pytest.fixture(scope="session")
def jobs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jobs")


STEPS = 40
# Runs that get a fault step slower than the reference (emulated compute only: the bits
# do not depend on it), so the window between "every rank passed step K" (status.json is
# written every 0.5 s) and the end of the job is seconds wide on a loaded box.
FAULT_STEP_TIME = 0.15


@pytest.fixture(scope="session")
def reference(slurm_cluster, jobs_root) -> Path:
    """Final state of a fault-free run: 4 ranks, 1 spare, STEPS steps."""
    lab.cluster("reset")
    run = lab.submit(jobs_root / "reference", steps=STEPS)
    code = run.wait()
    assert code == 0, run.output()
    return run.job_dir / "final.pt"


@pytest.fixture(scope="session")
def reference3(slurm_cluster, jobs_root) -> Path:
    """Final state of a fault-free run of 3 ranks (no spare: spares do not change the
    bits), STEPS steps; shared by the hetjob/executor and the healthy-spares tests."""
    lab.cluster("reset")
    run = lab.submit(jobs_root / "reference-3", nodes=3, spares=0, steps=STEPS)
    assert run.wait() == 0, run.output()
    assert "recovery_start" not in (run.job_dir / "events.jsonl").read_text()
    return run.job_dir / "final.pt"


@pytest.fixture(scope="session")
def torch_reference(slurm_cluster, jobs_root) -> Path:
    """The unmodified torchrun script's fault-free result under ``run`` (40 steps), shared
    by the relaunch tests (test_restart_slurm.py, test_rank0_node_slurm.py)."""
    from . import test_restart_slurm as restart

    lab.cluster("reset")
    proc, out = restart._run(jobs_root / "torchrun-ref", restart.TORCH_EXAMPLE, 40, mpi=False)
    assert restart._finish(proc, jobs_root / "torchrun-ref") == 0, proc.output
    return out
