#!/usr/bin/env python3
"""What a warm spare container saves: starting a process that imports torch, bare and
in a podman container (the image and mounts of the container tests), interleaved.

A warm standby pays this before any fault (docs/containers.md); an adoption that had
to start its container would pay it on the critical path. Writes JSON with --json.

    python benchmarks/container_start.py --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import emit, stats  # noqa: E402
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.config import load_config  # noqa: E402
from slurm_resilience.container.argv import for_job, wrap  # noqa: E402

PROBE = [sys.executable, "-c", "import torch, torch.distributed"]


def timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    sc = for_job(load_config({"container": lab.podman_section(lab.podman_test_image())}).container,
                 job_id="0", job_dir="/tmp", cwd=str(lab.REPO))
    podman = wrap(sc, PROBE, name="sr-0-bench-start", env_names=["PYTHONPATH"])
    cases = {"bare": PROBE, "podman": podman}
    for argv in cases.values():  # warm-up: page cache, image layers
        timed(argv)
    runs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, argv in cases.items():
            runs[name].append(round(timed(argv), 3))
    out = {k: stats(v) for k, v in runs.items()}
    out["podman_over_bare"] = round(out["podman"]["median_s"] / out["bare"]["median_s"], 2)
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
