#!/usr/bin/env python3
"""What a node's pulse process (worker/pulse.py) costs: CPU time, memory, start-up.

Starts --ranks child "ranks" on each of --nodes emulated nodes (each bumps its progress
page --rate times a second, as a training loop would); the first rank of each node
starts the node's pulse, all reporting to one real liveness server, for --seconds;
then reads each pulse's utime + stime and VmRSS from /proc.
Also times a progress bump (the only cost on the training thread). Not a test:
prints a table, --json writes it.

    python3 benchmarks/pulse_cost.py --nodes 2 --ranks 4 --seconds 30 --json /tmp/pulse.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience.supervisor.observe.detect import LivenessServer  # noqa: E402
from slurm_resilience.worker.progress_page import ProgressBoard  # noqa: E402
from slurm_resilience.worker.pulse import proc_stat  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402

RANK = r"""
import sys, time
from slurm_resilience.worker.progress_page import ProgressBoard, ensure_pulse
board = ProgressBoard(int(sys.argv[1]), sys.argv[6], sys.argv[4])
t0 = time.perf_counter()
pulse = ensure_pulse(sys.argv[6], host="127.0.0.1", period_s=float(sys.argv[3]),
                     hello={"token": sys.argv[2], "worker_id": "pulse@" + sys.argv[7], "node": sys.argv[7], "pid": 0})
print(pulse.pid if pulse else 0, time.perf_counter() - t0, flush=True)
dt, step = 1.0 / float(sys.argv[5]), 0
while True:
    step += 1
    board.bump(step=step)
    time.sleep(dt)
"""


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=4, help="ranks per node")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--period", type=float, default=0.25, help="detect.heartbeat_period_s")
    ap.add_argument("--rate", type=float, default=20.0, help="progress bumps per second per rank")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    token = os.urandom(16).hex()
    srv = LivenessServer("127.0.0.1", token, queue.Queue()).start()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    ranks, pulses, starts = [], [], []
    scratch = tempfile.mkdtemp(prefix="sr-pulse-cost-")  # 0700
    for n in range(args.nodes):
        directory = os.path.join(scratch, f"n{n}")
        os.mkdir(directory, 0o700)
        for i in range(args.ranks):
            p = subprocess.Popen([sys.executable, "-c", RANK, str(srv.port), token, str(args.period), f"n{n}.{i}",
                                  str(args.rate), directory, f"n{n}"], stdout=subprocess.PIPE, text=True, env=env)
            pid, spawn_s = p.stdout.readline().split()
            ranks.append(p)
            if int(pid):
                pulses.append(int(pid))
                starts.append(float(spawn_s))
    try:
        deadline = time.monotonic() + 30
        while len(srv.pulses()) < args.ranks * args.nodes and time.monotonic() < deadline:
            time.sleep(0.05)
        cpu0 = {pid: proc_stat(pid)[1] for pid in pulses}
        time.sleep(args.seconds)
        tick = os.sysconf("SC_CLK_TCK")
        cpu = [(proc_stat(pid)[1] - cpu0[pid]) / tick for pid in pulses]
        rss = [rss_kib(pid) for pid in pulses]
        seen = srv.pulses()
    finally:
        for p in ranks:  # ours, by pid; a node's pulse exits once its ranks are gone
            p.kill()
            p.wait(timeout=10)
        srv.close()
        shutil.rmtree(scratch, ignore_errors=True)
    board = ProgressBoard(0)
    n = 200_000
    t0 = time.perf_counter()
    for i in range(n):
        board.bump(step=i)
    bump_ns = (time.perf_counter() - t0) / n * 1e9
    share = [c / args.seconds * 100 for c in cpu]
    result = {
        "command": " ".join(sys.argv), "machine": platform.node(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nodes": args.nodes, "ranks_per_node": args.ranks,
        "pulse_processes": len(pulses), "seconds": args.seconds,
        "period_s": args.period, "cpu_percent_per_pulse": {"median": statistics.median(share), "min": min(share),
                                                            "max": max(share)},
        "rss_mib_per_pulse": {"median": statistics.median(rss) / 1024, "min": min(rss) / 1024, "max": max(rss) / 1024},
        "spawn_ms": {"median": statistics.median(starts) * 1000, "max": max(starts) * 1000},
        "progress_bump_ns": bump_ns, "pulses_seen": len(seen),
    }
    print(f"nodes: {args.nodes} x {args.ranks} ranks, pulse processes: {len(pulses)}, period {args.period} s, {args.seconds:.0f} s measured on "
          f"{result['machine']} ({result['cpus']} CPUs)")
    c, r = result["cpu_percent_per_pulse"], result["rss_mib_per_pulse"]
    print(f"CPU per pulse   median {c['median']:.3f} %  (min {c['min']:.3f}, max {c['max']:.3f})")
    print(f"RSS per pulse   median {r['median']:.1f} MiB (min {r['min']:.1f}, max {r['max']:.1f})")
    print(f"spawn (Popen)   median {result['spawn_ms']['median']:.1f} ms")
    print(f"progress bump   {bump_ns:.0f} ns on the training thread")
    if args.json:
        Path(args.json).write_text(json.dumps(stamped(result, __file__), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
