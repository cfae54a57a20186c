"""A degraded link on the local Slurm: from step 8 to the end of the job rank 1's node
drops each of its packets with probability P (``local-cluster lossy-node``), has
every connection shaped to a narrow RATE (``local-cluster slow-node``: a link that
negotiated down, a congested port), or has each of its packets held D ms
(``local-cluster delay-node``: a long or congested path); does the job finish,
bit-identical to the fault-free run, and what does the toolkit report?

One fault-free reference run, then one run per probability and per rate (the fault on
for the rest of that job, healed after it). Written per run: the exit code, how long
the degraded part took, the same steps' time in the reference, whether every rank's
final state equals the reference's, the faults detected and the alarms logged
(``straggler``, ``suspect``, ``progress_slow``, recoveries).

    python3 benchmarks/lossy.py --loss 0.1 0.3 --slow 4mbit 400kbit --delay 5 50 --json docs/results/degraded.json
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


def one(root: Path, fault: str, arg: str, reference: Path) -> dict:
    run = lab.submit(root / f"{fault}-{arg}", steps=STEPS, step_time=STEP_TIME)
    victim = run.wait_for_step(LOSSY_AT, timeout=900)["ranks"][1]["node"]
    try:
        t0 = lab.net_fault(fault, victim, arg)
        rc = run.wait(timeout=900)
        lossy_s = time.time() - t0
    finally:
        lab.net_fault("heal")
        lab.cluster("revive-node", victim, timeout=60)
    events = read_events(str(run.job_dir / "events.jsonl"))
    key = {"lossy-node": "loss", "slow-node": "rate", "delay-node": "delay_ms"}[fault]
    return {"fault": fault, key: arg if key == "rate" else float(arg), "victim": victim, "exit_code": rc,
            "degraded_part_s": round(lossy_s, 1),
            "bit_identical": rc == 0 and lab.compare_runs(reference, run.job_dir / "final.pt") == [],
            "faults": [e["fault"] for e in events if e["kind"] == "fault_detected"],
            "alarms": {k: sum(1 for e in events if e["kind"] == k) for k in ALARMS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", type=float, nargs="*", default=[0.1, 0.3], help="drop probabilities, each in (0, 1)")
    ap.add_argument("--slow", nargs="*", default=[], help="link rates for slow-node (tc units: 4mbit, 400kbit)")
    ap.add_argument("--delay", type=float, nargs="*", default=[], help="delay-node: ms each packet is held")
    ap.add_argument("--root", default="/tmp/sr-lossy")
    ap.add_argument("--json", default="lossy.json")
    args = ap.parse_args()
    if any(not 0 < p < 1 for p in args.loss):
        ap.error("each --loss must be in (0, 1)")
    if any(not 0 < d <= 10000 for d in args.delay):
        ap.error("each --delay must be in (0, 10000] ms")
    root = Path(args.root) / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    lab.cluster("reset")
    ref = lab.submit(root / "reference", steps=STEPS, step_time=STEP_TIME)
    if ref.wait(timeout=900) != 0:
        print(ref.output(), file=sys.stderr)
        return 1
    ev = read_events(str(ref.job_dir / "events.jsonl"))
    first = min(e["t"] for e in ev if e["kind"] == "rank_first_step")
    done = max(e["t"] for e in ev if e["kind"] == "rank_done")
    ref_part = round((done - first) / STEPS * (STEPS - LOSSY_AT), 1)  # its mean step time x the degraded steps
    runs = []
    for fault, values in (("lossy-node", [f"{p:g}" for p in args.loss]), ("slow-node", args.slow),
                          ("delay-node", [f"{d:g}" for d in args.delay])):
        for arg in values:
            runs.append(one(root, fault, arg, root / "reference" / "final.pt"))
            print(json.dumps(runs[-1]), flush=True)
    doc = stamped({"benchmark": "degraded-link", "steps": STEPS, "step_time_s": STEP_TIME,
                   "degraded_from_step": LOSSY_AT, "reference_same_steps_s": ref_part, "runs": runs}, __file__)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if all(r["bit_identical"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
