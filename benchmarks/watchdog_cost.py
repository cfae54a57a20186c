#!/usr/bin/env python3
"""What one look of the supervisor's step-progress watchdog costs at N ranks.

``ProgressWatch.observe`` (supervisor/observe/watchdog.py) folds every rank's pulse and
heartbeat into its verdicts once per heartbeat period: O(N) Python per look, the part of
the supervisor's steady CPU that grows with the ranks (docs/scale.md). This times that
call alone, in one process, on synthetic pulses of a healthy job (every rank's counter
moves every look, the beat in its node's pulse line, 8 ranks per node): median, min and
max over --looks looks after --warmup, for each --ranks. Not a test: prints a table,
--json writes it. Compare trees by running it with PYTHONPATH set to each (the JSON
records which):

    python3 benchmarks/watchdog_cost.py --ranks 1024 8192 16384 --json /tmp/watchdog.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # a tree to compare, given by PYTHONPATH, is on sys.path already
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience.supervisor.observe.detect import Pulse  # noqa: E402
from slurm_resilience.supervisor.observe.watchdog import ProgressWatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402

PERIOD_S = 0.25  # detect.heartbeat_period_s: the supervisor looks this often


def one_size(ranks: int, looks: int, warmup: int, per_node: int) -> dict:
    watch = ProgressWatch(stale_s=2.0, soft_s=10.0, hard_s=20.0, factor=10.0, pulse_s=PERIOD_S)
    wids = [f"n{i // per_node}.{i}" for i in range(ranks)]
    times = []
    for k in range(warmup + looks):
        now = 1000.0 + k * PERIOD_S
        pulses = {w: Pulse(now - 0.05, k, False, k // 2, "S", 100, beat_t=now - 0.1, generation=0, rank=i)
                  for i, w in enumerate(wids)}
        beats = {w: now - 0.1 for w in wids}
        t0 = time.perf_counter()
        watch.observe(beats, pulses, now)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    ms = [t * 1000 for t in times]
    return {"ranks": ranks, "looks": looks, "median_ms": round(statistics.median(ms), 3),
            "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3),
            "core_pct_at_period": round(statistics.median(ms) / (PERIOD_S * 1000) * 100, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192, 16384])
    ap.add_argument("--looks", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the commit)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if min(args.ranks) < 1 or args.looks < 1 or args.warmup < 0 or args.per_node < 1:
        print("watchdog_cost.py: --ranks, --looks and --per-node must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    rows = [one_size(n, args.looks, args.warmup, args.per_node) for n in args.ranks]
    print(f"{'ranks':>7} {'median ms':>10} {'min':>8} {'max':>8} {'% of a core':>12}")
    for r in rows:
        print(f"{r['ranks']:>7} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} {r['max_ms']:>8.2f} "
              f"{r['core_pct_at_period']:>12.1f}")
    if args.json:
        out = {"label": args.label, "period_s": PERIOD_S, "per_node": args.per_node,
               "pythonpath_set": bool(os.environ.get("PYTHONPATH")), "results": rows}
        Path(args.json).write_text(json.dumps(stamped(out, __file__), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
