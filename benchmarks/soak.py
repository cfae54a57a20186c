"""No-fault soak on the local Slurm: fault-free jobs back to back under load, at the
default detection deadlines (node silence 0.9 s, heartbeat timeout 2 s, peer probes
after a 2 s stall), counting every recovery and every alarm. The bar: zero.

Each job is the lab's example program at G ranks per node on ``--nodes`` worker nodes
plus a spare (the suite's own G = 2 shape: 8 ranks, 2 warm standbys, their pulses and
the supervisor on the 2 cores), and ``--hogs`` processes that spin on the CPU for the
whole soak (the load of a test suite running beside it). Nothing is injected. Counted
from each job's ``events.jsonl``: ``fault_detected``, ``recovery_done``, ``fallback``,
``suspect`` (a late heartbeat reported, never acted on), ``progress_slow``; the job's
exit code; and the box's load average while it ran.

    python3 benchmarks/soak.py --minutes 10 --json docs/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402

from slurm_resilience import lab  # noqa: E402
from slurm_resilience.events import read_events  # noqa: E402

COUNTED = ("fault_detected", "recovery_done", "fallback", "suspect", "progress_slow")
HOG = "while True: pass"


def one_job(root: Path, i: int, args: argparse.Namespace) -> dict:
    run = lab.submit(root / f"soak-{i:03d}", nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                     steps=args.steps, step_time=args.step_time)
    t0 = time.time()
    rc = run.wait(timeout=args.job_timeout)
    events = list(read_events(str(run.job_dir / "events.jsonl")))
    counts = {k: sum(1 for e in events if e["kind"] == k) for k in COUNTED}
    alarms = [{"kind": e["kind"], **{k: e[k] for k in ("worker_id", "evidence", "fault") if k in e}}
              for e in events if e["kind"] in COUNTED]
    return {"job": i, "exit_code": rc, "wall_s": round(time.time() - t0, 1), "load_after": os.getloadavg(),
            **counts, "alarms": alarms[:20]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="run jobs back to back this long")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--tasks-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--hogs", type=int, default=1, help="CPU-spinning processes beside the jobs")
    ap.add_argument("--job-timeout", type=float, default=600)
    ap.add_argument("--root", default="/tmp/sr-soak")
    ap.add_argument("--json", default="soak.json")
    args = ap.parse_args()
    if args.minutes <= 0 or args.nodes < 2 or args.tasks_per_node < 1 or args.hogs < 0:
        ap.error("--minutes > 0, --nodes >= 2, --tasks-per-node >= 1, --hogs >= 0")
    root = Path(args.root) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    lab.cluster("reset")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    jobs: list[dict] = []
    try:
        end = time.time() + 60 * args.minutes
        while time.time() < end:
            jobs.append(one_job(root, len(jobs), args))
            print(json.dumps({k: v for k, v in jobs[-1].items() if k != "alarms"}), flush=True)
    finally:
        for h in hogs:  # ours, by pid
            h.send_signal(signal.SIGTERM)
            h.wait(timeout=10)
    totals = {k: sum(j[k] for j in jobs) for k in COUNTED}
    doc = stamped({"benchmark": "soak", "nodes": args.nodes, "tasks_per_node": args.tasks_per_node,
                   "ranks_per_job": args.nodes * args.tasks_per_node, "steps": args.steps,
                   "step_time_s": args.step_time, "hogs": args.hogs, "minutes": args.minutes,
                   "jobs": len(jobs), "failed_jobs": sum(1 for j in jobs if j["exit_code"] != 0),
                   "rank_steps": sum(args.steps * args.nodes * args.tasks_per_node for _ in jobs),
                   "totals": totals, "per_job": jobs}, __file__)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(jobs)} jobs, {doc['failed_jobs']} failed; totals {totals}; wrote {args.json}")
    return 0 if doc["failed_jobs"] == 0 and totals["fault_detected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
