"""Golden sbatch script of `slurm-resilience run`, and quoting checked by running it."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.launch.restart import render_restart

GOLDEN = Path(__file__).parent / "golden" / "restart.sbatch"


HOSTILE_CMD = ["python", "train.py", "; rm -rf /", "$(touch PWNED)", "`touch PWNED`", "a'b\"c", "*",
               "--name=with space", "", "&& echo hi |", "$HOME"]
HOSTILE_DIR = "/tmp/my jobs/run $(touch PWNED); x"


def _stub(tmp_path: Path) -> str:
    """A "python" that records its argv (in a directory whose name has a space)."""
    d = tmp_path / "bin dir"
    d.mkdir()
    stub = d / "python"
    stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['SR_ARGV_OUT'], 'w').write(json.dumps(sys.argv[1:]))\n")
    stub.chmod(stat.S_IRWXU)
    return str(stub)


def _run_script(text: str, tmp_path: Path) -> list[str]:
    record, script = tmp_path / "argv.json", tmp_path / "job.sbatch"
    script.write_text(text)
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "SR_ARGV_OUT": str(record)})
    assert not (tmp_path / "PWNED").exists(), "a value was executed by the shell"
    assert r.returncode == 0, r.stderr
    return json.loads(record.read_text())


def _golden_render():
    cfg = load_config({"job": {"nodes": 3, "spares": 1, "partition": "debug", "time_limit": "01:30:00"}})
    return render_restart(cfg, command=["python", "train.py", "--steps", "100"], config_path="/home/u/c.yaml",
                          job_dir="/home/u/sr-jobs/42", mpi=True, python="/usr/bin/python3")


def test_matches_golden():
    text = _golden_render()
    if os.environ.get("SR_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_golden_essentials():
    lines = GOLDEN.read_text().splitlines()
    assert "#SBATCH --nodes=5" in lines  # 3 nodes + 1 spare + 1 supervisor node
    assert "#SBATCH --no-kill" in lines and "#SBATCH --requeue" in lines
    assert lines[-1].startswith("exec /usr/bin/python3 -m slurm_resilience.cli restart-supervise ")
    assert " --mpi -- python train.py" in lines[-1]


def test_torch_mode_has_no_mpi_flag():
    text = render_restart(load_config(), command=["x"], config_path="c", job_dir="d")
    assert "--mpi" not in text


def test_empty_command_raises():
    with pytest.raises(ConfigError, match="no training command"):
        render_restart(load_config(), command=[], config_path="c", job_dir="d")


def test_hostile_values_reach_the_supervisor_verbatim(tmp_path):
    text = render_restart(load_config(), command=HOSTILE_CMD, config_path="/c fg/$(touch PWNED).yaml",
                          job_dir=HOSTILE_DIR, mpi=True, python=_stub(tmp_path))
    argv = _run_script(text, tmp_path)
    assert argv == ["-m", "slurm_resilience.cli", "restart-supervise", "--config", "/c fg/$(touch PWNED).yaml",
                    "--job-dir", HOSTILE_DIR, "--mpi", "--", *HOSTILE_CMD]
