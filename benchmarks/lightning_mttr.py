#!/usr/bin/env python3
"""Recovery time of a Lightning Trainer that loses a node: ours against Lightning's own paths.

The same LightningModule/DataModule (examples/lightning_train*.py), 2 nodes x 2 ranks,
gloo on CPU, one thread per rank, the same epochs, step time and fault step for every
contender (benchmarks/lightning_mttr_cases.py says what each one is and how its fault is
injected). MTTR = the fault → rank 0's first completed step after the recovery. Every
contender runs --repeats times, interleaved (a slow spell of the box hits them alike);
median, min and max and the ratio of each baseline's median to ours go to --json.

    python benchmarks/lightning_mttr.py --repeats 3 --json docs/results/lightning-mttr.json

Lightning's SIGUSR1 auto-requeue (hpc_ckpt) needs the signal before the end: a node lost
without notice never gets it, so the requeue contender is Slurm's requeue on node failure
with the checkpoint a fast-recovering user keeps (last.ckpt every step).

Needs the cluster (eval "$(scripts/local-cluster env)") with 3 idle nodes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_mttr_cases import CONTENDERS  # noqa: E402
from provenance import stamped  # noqa: E402

OURS = "ours"


def stats(values: list[float]) -> dict:
    v = sorted(values)
    if not v:
        return {"median_s": None, "min_s": None, "max_s": None, "n": 0}
    return {"median_s": round(statistics.median(v), 3), "min_s": v[0], "max_s": v[-1], "n": len(v)}


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender: median/min/max of the MTTR, and how many runs had no step after the fault
    (or failed); for each baseline, its median over ours ("the baseline takes N times as long")."""
    out = {name: {**stats([r["mttr_s"] for r in rs if r.get("mttr_s") is not None]),
                  "no_recovery": sum(r.get("mttr_s") is None for r in rs), "runs": rs}
           for name, rs in runs.items()}
    ours = out.get(OURS, {}).get("median_s")
    for name, r in out.items():
        if name != OURS and ours and r["median_s"]:
            r["ratio_to_ours"] = round(r["median_s"] / ours, 2)
    return out


def table(results: dict[str, dict]) -> str:
    def f(x):
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"
    lines = [f"{'contender':<10}{'median (s)':>11}{'min':>8}{'max':>8}{'n':>3}{'/ ours':>9}{'no recovery':>13}"]
    for name, r in results.items():
        ratio = f"{r['ratio_to_ours']:.1f}x" if "ratio_to_ours" in r else "-"
        lines.append(f"{name:<10}{f(r['median_s']):>11}{f(r['min_s']):>8}{f(r['max_s']):>8}{r['n']:>3}{ratio:>9}"
                     f"{r['no_recovery']:>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3, help="8 steps per epoch at 4 ranks (default %(default)s)")
    ap.add_argument("--kill-at", type=int, default=10, help="the fault once rank 0 reported this step")
    ap.add_argument("--step-time", type=float, default=0.2, help="emulated compute per step (s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-restarts", type=int, default=10, help="torchrun's --max-restarts (default %(default)s)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, of: %(default)s")
    ap.add_argument("--recovery-timeout", type=float, default=90.0,
                    help="torchrun: no step this long after the kill is reported as not recovered (s)")
    ap.add_argument("--torchrun-kill", choices=("node", "rank"), default="node",
                    help="torchrun: SIGKILL the node's two ranks with their DataLoader workers, or only its "
                         "last rank's process")
    ap.add_argument("--torchrun-store", choices=("fresh", "shared"), default="fresh",
                    help="torchrun: a fresh c10d store per restart (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), or the "
                         "agent's store shared across restarts (torch's default, keeps the dead attempt's keys)")
    ap.add_argument("--json", default="lightning-mttr.json")
    args = ap.parse_args(argv)
    names = [n for n in args.contenders.split(",") if n]
    if any(n not in CONTENDERS for n in names):
        ap.error(f"--contenders: choose from {', '.join(CONTENDERS)}")
    if args.repeats < 1 or not 0 < args.kill_at < 8 * args.epochs:
        ap.error("need --repeats >= 1 and 0 < --kill-at < 8 x --epochs")
    root = Path(tempfile.mkdtemp(prefix="lightning-mttr-"))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name in names:
            run_root = root / f"r{rep}" / name
            run_root.mkdir(parents=True)
            try:
                r = CONTENDERS[name](run_root, args)
            except Exception as exc:  # one failed run is reported, the others still run
                r = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)}
            runs.setdefault(name, []).append(r)
            print(f"{name:<10} run {rep + 1}/{args.repeats} "
                  f"{json.dumps({k: v for k, v in r.items() if k != 'trace'})}", flush=True)
            _write(args, argv, started, root, runs)  # after every run: a cut-short benchmark keeps its runs
    print("\n" + table(summarize(runs)))
    print(f"\nwrote {args.json}")
    return 0


def _write(args, argv, started: str, root: Path, runs: dict[str, list[dict]]) -> None:
    doc = {"benchmark": "lightning-mttr", "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
           "started": started, "machine": platform.node(), "cpus": os.cpu_count(),
           "setup": "2 nodes x 2 ranks, gloo on CPU, 1 thread per rank, examples/lightning_train*.py's "
                    "LightningModule/DataModule; MTTR = fault -> rank 0's first completed step after recovery",
           "args": vars(args), "work_dir": str(root), "loadavg_1min_at_write": os.getloadavg()[0],
           "results": summarize(runs)}
    Path(args.json).write_text(json.dumps(stamped(doc, __file__), indent=2))


if __name__ == "__main__":
    sys.exit(main())
