"""The `slurm-resilience run` cases of benchmarks/mttr.py: an unmodified torchrun-style
script (examples/train_torchrun.py) relaunched cold (a new srun step imports torch) or
warm (forked by the per-node zygotes, docs/restart.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402

def run_relaunch(root: Path, args, *, warm: bool) -> dict:
    """`slurm-resilience run` relaunch of an unmodified script: kill a worker node once
    the first snapshot exists; MTTR = kill → the relaunched rank 0's first step."""
    try:
        lab.cluster("reset")
    except RuntimeError as exc:  # a node held by a job that is not ours: this case revives its own victim
        print(f"warning: {exc}", file=sys.stderr)
    job = root / f"run-{'warm' if warm else 'cold'}"
    job.mkdir(parents=True)
    (job / "config.yaml").write_text(f"run:\n  warm: {str(warm).lower()}\n")
    stamps = job / "stamps.txt"
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--config", str(job / "config.yaml"),
            "--nodes", "3", "--spares", "1", "--job-dir", str(job / "job"), "--", sys.executable,
            str(lab.REPO / "examples" / "train_torchrun.py"), "--steps", str(args.steps), "--ckpt", str(job / "ckpt"),
            "--out", str(job / "final.pt"), "--stamps", str(stamps)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    deadline = time.time() + 180
    while not (job / "ckpt" / "snapshot.pt").exists():
        assert time.time() < deadline and proc.poll() is None, "no snapshot"
        time.sleep(0.02)
    victim = json.loads((job / "job" / "status.json").read_text())["nodes"][1]
    t_fault = lab.kill_node(victim)
    code = proc.wait(timeout=300)
    lab.cluster("revive-node", victim)
    lines = [ln.split() for ln in stamps.read_text().splitlines()] if stamps.exists() else []
    after = [float(t) for restart, _, t in lines if int(restart) >= 1 and float(t) > t_fault]
    return {"exit_code": code, "mttr_s": round(min(after) - t_fault, 3) if after else None,
            "level": f"run relaunch ({'warm: zygote fork' if warm else 'cold: new srun step'})"}


RUN_CASES = {"run-cold": False, "run-warm": True}
