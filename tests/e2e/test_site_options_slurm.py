"""End to end on the real local Slurm: a hetjob with site options the lab accepts —
--comment, --mem, --constraint (node feature `srlocal`), the supervisor on a
partition of its own (`sup`) with its own --mem, a setup line whose export the
ranks inherit, and an srun option on every step. Not exercised here (the lab
lacks them): --account/--qos (no accounting), --reservation, GRES/GPUs."""

import os
import time

import yaml

import pytest

from slurm_resilience import lab
from slurm_resilience.slurm import commands

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


def _procs_with(marker: bytes) -> dict[int, bytes]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if marker in env:
            out[int(pid)] = cmd + b"\0ENV\0" + env
    return out


def test_hetjob_with_site_options_runs_and_slurm_took_them(cluster, jobs_root, tmp_path):
    cfg = yaml.safe_load(lab.LOCAL_CONFIG.read_text()) or {}
    cfg.setdefault("job", {}).update(
        supervisor_partition="sup", supervisor_sbatch_options={"mem": "1000M"},
        sbatch_options={"comment": "sr-site-e2e", "mem": "1800M", "constraint": "srlocal"})
    config = tmp_path / "site.yaml"
    config.write_text(yaml.safe_dump(cfg))
    job_dir = jobs_root / "site-options"
    mark = f"sr-site-{os.getpid()}"
    run = lab.submit(job_dir, nodes=2, spares=1, steps=30, config=config, hetjob=True,
                     cli_args=["--setup", f"export SR_SITE_MARK={mark}", "--srun-option", "cpu-bind=none"])
    seen: dict[int, bytes] = {}
    while run.process.poll() is None:
        seen.update(_procs_with(f"SR_SITE_MARK={mark}".encode()))
        time.sleep(0.3)
    assert run.wait() == 0, run.output()
    script = (job_dir / "job.sbatch").read_text()
    assert "#SBATCH --comment=sr-site-e2e" in script and "#SBATCH --partition=sup" in script
    job_id = (job_dir / "submitted-config.yaml").exists() and run.output().split("submitted job ")[1].split(";")[0]
    shown = commands.run(["scontrol", "show", "job", job_id]).stdout  # MinJobAge keeps the record
    comps = shown.split("\n\n")
    sup = next(c for c in comps if "HetJobOffset=0" in c)
    workers = next(c for c in comps if "HetJobOffset=1" in c)
    assert "Partition=sup" in sup and "MinMemoryNode=1000M" in sup and "Features=srlocal" not in sup
    assert "Partition=debug" in workers and "MinMemoryNode=1800M" in workers and "Features=srlocal" in workers
    assert "Comment=sr-site-e2e" in sup and "Comment=sr-site-e2e" in workers
    # the setup line's export reached the supervisor and the rank/standby processes of the steps;
    # the steps' srun clients carried the site option
    steps = [v for v in seen.values() if b"SLURM_STEP_ID=" in v and b"SLURM_STEP_ID=batch" not in v]
    sruns = [v for v in seen.values() if v.startswith(b"srun\0") and b"--cpu-bind=none" in v]
    assert len(steps) >= 3, f"{len(seen)} processes with the mark, {len(steps)} in steps"
    assert len(sruns) >= 3
