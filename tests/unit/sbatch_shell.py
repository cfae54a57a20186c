"""Shared by the sbatch golden tests: hostile values, and running a rendered script
with a stub "python" that records the argv it was given."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

HOSTILE_CMD = ["python", "train.py", "; rm -rf /", "$(touch PWNED)", "`touch PWNED`",
               "a'b\"c", "*", "--name=with space", "", "&& echo hi |", "$HOME"]
HOSTILE_DIR = "/tmp/my jobs/run $(touch PWNED); x"


def stub_python(tmp_path: Path) -> str:
    """A "python" that records its argv (in a directory whose name has a space)."""
    d = tmp_path / "bin dir"
    d.mkdir()
    stub = d / "python"
    stub.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['SR_ARGV_OUT'], 'w').write(json.dumps(sys.argv[1:]))\n")
    stub.chmod(stat.S_IRWXU)
    return str(stub)


def run_script(text: str, tmp_path: Path) -> list[str]:
    """Run the rendered script with bash; returns the argv the stub python received."""
    record, script = tmp_path / "argv.json", tmp_path / "job.sbatch"
    script.write_text(text)
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "SR_ARGV_OUT": str(record)})
    assert not (tmp_path / "PWNED").exists(), "a value was executed by the shell"
    assert r.returncode == 0, r.stderr
    return json.loads(record.read_text())
