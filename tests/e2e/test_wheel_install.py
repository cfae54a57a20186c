"""Installs like a library: a wheel, installed into a fresh venv, submits a job.

The venv is made without ``--system-site-packages``: the system Python here holds
an *editable* install of this project, whose meta-path finder (loaded by its .pth)
would shadow the wheel. torch and the other dependencies come from the system's
site-packages directory, added to the venv as a plain path line in a .pth file
(a plain path does not run the .pth files of that directory), so nothing is
downloaded. ``submit`` runs from the venv's own ``slurm-resilience`` script, in a
directory outside the checkout, with no PYTHONPATH.
"""

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


def _run(argv, **kw):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, **kw)
    assert proc.returncode == 0, f"{argv}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def test_submit_from_a_wheel_in_a_fresh_venv(cluster, tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SR_TEMPLATE_DIR")}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(tmp_path / "dist"), str(lab.REPO)], env=clean, cwd=tmp_path)
    wheel, = (tmp_path / "dist").glob("slurm_resilience-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=clean)  # its own pip: script shebangs name the venv
    py = venv / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    (Path(purelib) / "_system_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env=clean, cwd=tmp_path)
    where = _run([str(py), "-c", "import slurm_resilience; print(slurm_resilience.__file__)"],
                 env=clean, cwd=tmp_path)
    assert where.startswith(purelib), where  # the wheel, not the checkout
    assert (Path(purelib) / "slurm_resilience" / "templates" / "resilient.sbatch.tmpl").exists()
    job_dir = tmp_path / "job"
    _run([str(venv / "bin" / "slurm-resilience"), "submit", "--wait", "--nodes", "2", "--spares", "0",
          "--job-dir", str(job_dir), "--config", str(lab.LOCAL_CONFIG), "--",
          str(py), str(lab.EXAMPLE), "--steps", "6", "--step-time", "0.01"], env=clean, cwd=tmp_path)
    events = read_events(str(job_dir / "events.jsonl"))
    assert [e for e in events if e["kind"] == "job_done"], events[-3:]
    assert (job_dir / "final.pt").exists()
    assert str(py) in (job_dir / "job.sbatch").read_text()  # the batch step runs the venv's interpreter
