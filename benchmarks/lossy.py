"""A degraded link on the local Slurm: rank 1's node drops each of its packets with
probability P (``local-cluster lossy-node``) from step 8 to the end of the job; does the
job finish, bit-identical to the fault-free run, and what does the toolkit report?

One fault-free reference run, then one run per probability (the loss on for the rest of
that job, healed after it). Written per run: the exit code, how long the lossy part
took, whether every rank's final state equals the reference's, the faults detected
and the alarms logged (``straggler``, ``suspect``, ``progress_slow``, recoveries).

    python3 benchmarks/lossy.py --loss 0.1 0.3 --json docs/results/lossy.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402

from slurm_resilience import lab  # noqa: E402
from slurm_resilience.events import read_events  # noqa: E402

ALARMS = ("fault_detected", "recovery_done", "straggler", "suspect", "progress_slow", "fallback")
STEPS, STEP_TIME, LOSSY_AT = 40, 0.15, 8


def one(root: Path, loss: float, reference: Path) -> dict:
    run = lab.submit(root / f"lossy-{loss:g}", steps=STEPS, step_time=STEP_TIME)
    victim = run.wait_for_step(LOSSY_AT, timeout=900)["ranks"][1]["node"]
    try:
        t0 = lab.net_fault("lossy-node", victim, f"{loss:g}")
        rc = run.wait(timeout=900)
        lossy_s = time.time() - t0
    finally:
        lab.net_fault("heal")
        lab.cluster("revive-node", victim, timeout=60)
    events = read_events(str(run.job_dir / "events.jsonl"))
    return {"loss": loss, "victim": victim, "exit_code": rc, "lossy_part_s": round(lossy_s, 1),
            "bit_identical": rc == 0 and lab.compare_runs(reference, run.job_dir / "final.pt") == [],
            "faults": [e["fault"] for e in events if e["kind"] == "fault_detected"],
            "alarms": {k: sum(1 for e in events if e["kind"] == k) for k in ALARMS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", type=float, nargs="+", default=[0.1, 0.3], help="drop probabilities, each in (0, 1)")
    ap.add_argument("--root", default="/tmp/sr-lossy")
    ap.add_argument("--json", default="lossy.json")
    args = ap.parse_args()
    if any(not 0 < p < 1 for p in args.loss):
        ap.error("each --loss must be in (0, 1)")
    root = Path(args.root) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    lab.cluster("reset")
    ref = lab.submit(root / "reference", steps=STEPS, step_time=STEP_TIME)
    if ref.wait(timeout=900) != 0:
        print(ref.output(), file=sys.stderr)
        return 1
    runs = []
    for p in args.loss:
        runs.append(one(root, p, root / "reference" / "final.pt"))
        print(json.dumps(runs[-1]), flush=True)
    doc = stamped({"benchmark": "lossy", "steps": STEPS, "step_time_s": STEP_TIME, "lossy_from_step": LOSSY_AT,
                   "fault_free_s_per_step": STEP_TIME, "runs": runs}, __file__)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(r["bit_identical"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
