"""benchmarks/restore_device.py: its argument checks, and a one-line refusal without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "restore_device.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_bad_arguments_are_a_usage_error():
    p = run("--repeat", "0")
    assert p.returncode == 2 and "--repeat and --tensors must be >= 1" in p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark runs")
def test_without_a_gpu_it_says_so_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "r.json"
    p = run("--json", str(out))
    assert p.returncode == 2
    assert p.stderr.strip() == "restore_device.py: error: needs a CUDA GPU"
    assert not out.exists()
