"""Golden sbatch script of `slurm-resilience run`, and quoting checked by running it."""

import os
from pathlib import Path

import pytest

from slurm_resilience.config import load_config

from sbatch_shell import HOSTILE_CMD, HOSTILE_DIR, run_script, stub_python
from slurm_resilience.errors import ConfigError
from slurm_resilience.launch.restart import render_restart

GOLDEN = Path(__file__).parent / "golden" / "restart.sbatch"


def _golden_render():
    cfg = load_config({"job": {"nodes": 3, "spares": 1, "tasks_per_node": 2, "partition": "debug",
                               "time_limit": "01:30:00"}})
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
    assert "#SBATCH --ntasks-per-node=2" in lines  # one step of 3 x 2 ranks; the spare fits 2
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
                          job_dir=HOSTILE_DIR, mpi=True, python=stub_python(tmp_path))
    argv = run_script(text, tmp_path)
    assert argv == ["-m", "slurm_resilience.cli", "restart-supervise", "--config", "/c fg/$(touch PWNED).yaml",
                    "--job-dir", HOSTILE_DIR, "--mpi", "--", *HOSTILE_CMD]
