#!/usr/bin/env python3
"""What one supervisor poll of N heartbeat keys costs on one TCPStore (loopback).

Two read patterns over the same store, keys, repeats and process: the one the
supervisor used until issue 23 (one ``check`` round trip per worker, then one
``multi_get``) and ``supervisor/observe/heartbeats.read_heartbeats`` as it is now (one ``check`` of
all keys, one ``multi_get``; bisection only while some worker has not beaten yet).
Every key holds a heartbeat as ``worker/heartbeat.py`` writes it. No writers run
meanwhile, so this is the poll's own floor; ``benchmarks/scale.py`` measures it
under thousands of writing ranks. Not a test: prints, ``--json`` writes.

    python3 benchmarks/store_poll.py --keys 1024 4096 16384 --repeats 7 --json /tmp/poll.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import run_and_write, stats  # noqa: E402
from slurm_resilience.protocol import StoreKey  # noqa: E402
from slurm_resilience.supervisor.observe.heartbeats import read_heartbeats  # noqa: E402


def per_key_check(store, keys: dict[str, str]) -> dict:
    """The pre-issue-23 pattern: a round trip per worker to see whether it beat."""
    present = [w for w in keys if store.check([keys[w]])]
    values = store.multi_get([keys[w] for w in present]) if present else []
    return {w: json.loads(bytes(v)) for w, v in zip(present, values)}


CONTENDERS = {"per_key_check": per_key_check, "batched": read_heartbeats}


def run(args) -> dict:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=60), wait_for_workers=False)
    rows = []
    for n in args.keys:
        keys = {f"n{i // 8}.{i}": StoreKey.HEARTBEAT.of(f"n{i // 8}.{i}") for i in range(n)}
        beat = json.dumps({"t": time.time(), "step": 1234, "pid": 99999, "generation": 0, "rank": 0,
                           "phase": "step", "progress": 123456})
        client.multi_set(list(keys.values()), [beat] * n)
        for name, read in CONTENDERS.items():
            read(client, keys)  # the same warm-up for each
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                got = read(client, keys)
                times.append(time.perf_counter() - t0)
                assert len(got) == n
            rows.append({"keys": n, "read": name, **stats(times)})
    by = {(r["keys"], r["read"]): r["median_s"] for r in rows}
    for n in args.keys:
        for r in rows:
            if r["keys"] == n and r["read"] == "batched":
                r["speedup_vs_per_key"] = by[(n, "per_key_check")] / by[(n, "batched")]
    return {"rows": rows}


def report(figures: dict) -> str:
    lines = ["keys   read            median ms   min ms   max ms"]
    for r in figures["rows"]:
        lines.append(f"{r['keys']:>6} {r['read']:<15} {r['median_s'] * 1e3:9.1f} {r['min_s'] * 1e3:8.1f} "
                     f"{r['max_s'] * 1e3:8.1f}" + (f"   x{r['speedup_vs_per_key']:.1f}" if "speedup_vs_per_key" in r else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="store_poll.json")
    args = ap.parse_args()
    if args.repeats < 1 or any(k < 1 for k in args.keys):
        ap.error("--repeats and --keys must be >= 1")
    return run_and_write(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
