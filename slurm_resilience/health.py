"""The spare-node health check, run ON the node (an srun step) before a spare is trusted.

    python -m slurm_resilience.health --local-dir DIR --min-free-gb X [--gpus N]
        [--timeout-s T] [-- USER COMMAND ...]

Checks, in order, stopping at the first failure:

1. the node-local checkpoint directory exists (it is created 0700 if missing, as the
   engine would), a file can be written, fsynced and removed there, and the
   filesystem has at least ``--min-free-gb`` free (``checkpoint.local_min_free_gb``);
2. with ``--gpus N`` > 0: ``nvidia-smi`` lists N GPUs and none has retired pages
   pending (a GPU that needs a reset before it can be trusted);
3. the user's command (``recovery.health_check``, an argv list run without a shell)
   exits 0 within ``--timeout-s``.

Prints ``ok`` or one line saying what failed, and exits 0 or 1. The supervisor turns
a failure into a drained spare with that line as the reason. "The standby process
answers" is checked by the supervisor itself (its liveness connection is up).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Sequence
from .checkpoint.layout import current_user


__all__ = [
    "GIB", "check_local_dir", "parse_gpu_query", "check_gpus", "check_command", "run_checks", "health_argv", "main"
]


GIB = 1 << 30


def check_local_dir(path: str, min_free_gb: float,
                    usage: Callable[[str], "shutil._ntuple_diskusage"] = shutil.disk_usage) -> str | None:
    """None when ``path`` is a usable node-local checkpoint directory, else why not."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".health-", dir=path)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        return f"node-local checkpoint directory {path} is not writable: {exc.strerror or exc}"
    free = usage(path).free / GIB
    if free < min_free_gb:
        return (f"node-local checkpoint directory {path} has {free:.2f} GiB free, "
                f"checkpoint.local_min_free_gb is {min_free_gb:g}")
    return None


def parse_gpu_query(text: str, expected: int) -> str | None:
    """``nvidia-smi --query-gpu=index,retired_pages.pending --format=csv,noheader`` output
    → None when ``expected`` GPUs are listed and none has retired pages pending."""
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]
    if len(rows) != expected:
        return f"nvidia-smi sees {len(rows)} GPU(s), expected {expected}"
    pending = [r[0] for r in rows if len(r) > 1 and r[1].lower() == "yes"]
    if pending:
        return f"GPU(s) {', '.join(pending)} have retired pages pending (reset needed)"
    return None


def check_gpus(expected: int, timeout_s: float) -> str | None:
    """None when nvidia-smi lists ``expected`` GPUs and none has pending retired pages; else why not."""
    argv = ["nvidia-smi", "--query-gpu=index,retired_pages.pending", "--format=csv,noheader"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return f"nvidia-smi not found, {expected} GPU(s) expected"
    except subprocess.TimeoutExpired:
        return f"nvidia-smi did not answer within {timeout_s:g}s"
    if out.returncode != 0:
        return f"nvidia-smi failed (exit {out.returncode}): {_line(out.stderr or out.stdout)}"
    return parse_gpu_query(out.stdout, expected)


def check_command(argv: Sequence[str], timeout_s: float) -> str | None:
    """None when the user's health command exits 0 within ``timeout_s``."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                             stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"health_check command not found: {argv[0]}"
    except subprocess.TimeoutExpired:
        return f"health_check {argv[0]} did not finish within {timeout_s:g}s"
    if out.returncode != 0:
        said = _line(out.stdout + out.stderr)
        return f"health_check {argv[0]} exited {out.returncode}" + (f": {said}" if said else "")
    return None


def run_checks(*, local_dir: str, min_free_gb: float, gpus: int, command: Sequence[str],
               timeout_s: float) -> str | None:
    """Every check in order; the first failure, or None."""
    return (check_local_dir(local_dir, min_free_gb)
            or (check_gpus(gpus, timeout_s) if gpus > 0 else None)
            or (check_command(command, timeout_s) if command else None))


def health_argv(cfg, *, job_id: str, run_id: str, job_dir: str, node: str,
                python: str = sys.executable) -> list[str]:
    """Pure: the argv that runs these checks on ``node`` for this job's config (the node's
    L1 directory as ``checkpoint.local_dir`` names it; with ``{rank}`` in it, local rank
    0's; GPUs expected: one per rank on NCCL)."""
    local = next((t for t in cfg.checkpoint.tiers() if t.storage == "local"), None)
    path = local.path if local is not None else cfg.checkpoint.local_dir
    local_dir = path.format_map({"job_id": job_id, "run_id": run_id, "node": node, "rank": 0, "job_dir": job_dir,
                                  "user": current_user()})
    gpus = cfg.job.tasks_per_node if cfg.reconnect.backend == "nccl" else 0
    argv = [python, "-m", "slurm_resilience.health", "--local-dir", local_dir,
            "--min-free-gb", str(cfg.checkpoint.local_min_free_gb), "--gpus", str(gpus),
            "--timeout-s", str(cfg.recovery.health_check_timeout_s)]
    return [*argv, "--", *cfg.recovery.health_check] if cfg.recovery.health_check else argv


def _line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slurm_resilience.health``: run the checks, print "ok" or why not; exit 0 or 1."""
    ap = argparse.ArgumentParser(prog="python -m slurm_resilience.health", description=__doc__.splitlines()[0])
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--min-free-gb", type=float, default=0.0)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    why = run_checks(local_dir=a.local_dir, min_free_gb=a.min_free_gb, gpus=a.gpus, command=command,
                     timeout_s=a.timeout_s)
    print(why or "ok", flush=True)
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
