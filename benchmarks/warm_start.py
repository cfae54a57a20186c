#!/usr/bin/env python3
"""Cold start vs. zygote fork of an unmodified program's ranks, on this host (no Slurm).

The part of a `slurm-resilience run` relaunch that the zygotes change: from "start the
ranks" to rank 0's first completed step, its own snapshot load and gloo rendezvous
included. examples/train_torchrun.py, 3 ranks on localhost, resuming from its step-10
snapshot for one step. Cold: 3 new `python` processes (each imports torch), as the
relaunch step's tasks. Warm: 3 ranks forked by one zygote (`supervisor/adapters/warm.py`
ZygotePool, the zygote started as a plain process with a one-task step's SLURM_*
variables, as tests/local/test_zygote_local.py does). Interleaved repeats; median/min/max.

    python benchmarks/warm_start.py --repeats 5 --json /tmp/warm_start.json
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from figures import emit, stats  # noqa: E402
from slurm_resilience.supervisor.adapters.warm import ZygotePool  # noqa: E402

EXAMPLE = REPO / "examples" / "train_torchrun.py"
WORLD = 3


class _Step:
    def __init__(self, process, name, node):
        self.process, self.name, self.node = process, name, node


class LocalLauncher:
    """The zygote "step" as a plain process with a one-task step's SLURM_* variables."""

    def address(self, node):
        return "127.0.0.1"

    def launch(self, *, name, node, argv, env, log_path):
        step_env = {**os.environ, **env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                    "SLURM_NTASKS": "1", "SLURMD_NODENAME": node}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, env=step_env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return _Step(proc, name, node)

    def kill(self, handle):
        if handle.process.poll() is None:
            os.killpg(handle.process.pid, signal.SIGKILL)
            handle.process.wait()


def command(root: Path, steps: int) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--steps", str(steps), "--ckpt", str(root / "ckpt"),
            "--out", str(root / "final.pt"), "--stamps", str(root / "stamps.txt")]


def first_stamp(root: Path, t0: float, ended=lambda: False, timeout: float = 120) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline and not ended():
        try:
            lines = [ln.split() for ln in (root / "stamps.txt").read_text().splitlines()]
            after = [float(t) for restart, _, t in lines if restart == "1" and float(t) > t0]
            if after:
                return min(after) - t0
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    raise RuntimeError(f"no step within the time-out, or the ranks ended: see {root}")


def cold(root: Path, port: int) -> float:
    (root / "stamps.txt").unlink(missing_ok=True)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
            "GLOO_SOCKET_IFNAME": "lo", "SR_RESTART": "1", "LOCAL_WORLD_SIZE": str(WORLD), "GROUP_RANK": "0"}
    t0 = time.time()
    procs = [subprocess.Popen(command(root, 11), env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(WORLD)]
    took = first_stamp(root, t0, ended=lambda: any(p.poll() not in (None, 0) for p in procs))
    assert all(p.wait(timeout=120) == 0 for p in procs), "a cold rank failed"
    return took


def warm(root: Path, pool: ZygotePool, port: int) -> float:
    (root / "stamps.txt").unlink(missing_ok=True)
    t0 = time.time()
    step = pool.fork_step(name="sr-restart-1", nodes=["local"], tasks_per_node=WORLD, command=command(root, 11),
                          master_addr="127.0.0.1", port=port, attempt=1, log_path=str(root / "warm.log"))
    assert step is not None, (root / "zygote-local.log").read_text()
    took = first_stamp(root, t0, ended=lambda: step.poll() not in (None, 0))
    while (code := step.poll()) is None:
        time.sleep(0.01)
    assert code == 0, f"a warm rank failed: {(root / 'warm.log').read_text()[-2000:]}"
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    root = Path(tempfile.mkdtemp(prefix="warm-start-"))
    os.chmod(root, 0o700)
    # the snapshot both resume from (step 10), and the file cache warm for both
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29411", "WORLD_SIZE": str(WORLD)}
    procs = [subprocess.Popen(command(root, 10), env={**base, "RANK": str(r)}) for r in range(WORLD)]
    assert all(p.wait(timeout=300) == 0 for p in procs) and (root / "ckpt" / "snapshot.pt").exists()
    pool = ZygotePool(job_dir=str(root), nodes=["local"], launcher=LocalLauncher())
    assert pool.wait_ready(["local"], 120), (root / "zygote-local.log").read_text()
    runs: dict[str, list[float]] = {"cold": [], "warm": []}
    try:
        for rep in range(args.repeats):
            runs["cold"].append(cold(root, 29420 + 2 * rep))
            runs["warm"].append(warm(root, pool, 29421 + 2 * rep))
            print(f"run {rep + 1}/{args.repeats}: cold {runs['cold'][-1]:.3f} s, warm {runs['warm'][-1]:.3f} s",
                  flush=True)
    finally:
        pool.close()
    out = {name: stats(v) for name, v in runs.items()}
    out["speedup"] = out["cold"]["median_s"] / out["warm"]["median_s"]
    emit(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
