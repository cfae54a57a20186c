#!/usr/bin/env python3
"""The demo: a 4-node job loses a node mid-run and finishes on the spare, bit-identical.

Runs a fault-free reference and a faulty run of examples/train_mlp.py on the local
cluster (4 worker nodes + 1 spare + the supervisor's node; --tasks-per-node G puts
G ranks on each worker node and G standbys on the spare), kills a worker node
(hard: slurmd, slurmstepd and tasks by PID) in the middle — or, with
``--fault freeze-node``, stops it silently (slurmd and its job cgroups frozen, nothing
closed; thawed and revived after the job), or with ``--fault partition-node`` cuts it
off the network (its processes run on; healed and revived after the job) —, prints
the recovery timeline, compares
the final weights, draws OUT/timeline.png and writes OUT/demo-summary.json.
The fault goes in through ``slurm-resilience inject``'s code, which records it in the
job's ``injected.jsonl``: ``slurm-resilience timeline JOBDIR --png FILE`` redraws the
same picture later. Exit 0 only if the weights are bit-identical.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.inject import inject  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo-out", help="output directory")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at-step", type=int, default=25)
    ap.add_argument("--tasks-per-node", type=int, default=1, metavar="G",
                    help="ranks per worker node (standbys per spare); the local cluster fits G <= its CPUs per node")
    ap.add_argument("--fault", choices=("kill-node", "freeze-node", "partition-node"), default="kill-node",
                    help="kill-node: hard loss (connections reset); freeze-node: silent loss (nothing closes); "
                         "partition-node: the node cut off the network, its processes still running")
    args = ap.parse_args()
    if args.tasks_per_node < 1:
        ap.error(f"--tasks-per-node={args.tasks_per_node} must be >= 1")
    g = args.tasks_per_node
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    shape = f"4 nodes x {g} ranks + 1 spare" if g > 1 else "4 nodes + 1 spare"
    print(f"== fault-free reference run ({shape})", flush=True)
    lab.cluster("reset")  # a node killed earlier (a test, a previous demo) is revived first
    ref = lab.submit(out / f"reference-{stamp}", steps=args.steps, tasks_per_node=g)
    if ref.wait() != 0:
        print(ref.output(), file=sys.stderr)
        print("demo: the reference run failed", file=sys.stderr)
        return 1

    verb = {"kill-node": "kill", "freeze-node": "freeze", "partition-node": "partition"}[args.fault]
    print(f"== faulty run: {verb} a worker node once every rank has done {args.kill_at_step} steps", flush=True)
    run = lab.submit(out / f"faulty-{stamp}", steps=args.steps, tasks_per_node=g)
    status = run.wait_for_step(args.kill_at_step)
    injected = inject(args.fault, str(run.job_dir), rank=1)  # recorded in the job's injected.jsonl
    victim, fault_at = injected["node"], injected["at"]
    try:
        lost = [r["rank"] for r in status["ranks"] if r["node"] == victim]
        print(f"   {dict(kill='killed', freeze='froze', partition='partitioned')[verb]} node {victim} (rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}) "
              f"at step ~{status['ranks'][1]['step']}", flush=True)
        code = run.wait()
        print(run.output(), flush=True)
    finally:
        if args.fault == "freeze-node":
            lab.thaw_and_revive(victim)
        elif args.fault == "partition-node":
            lab.net_fault("heal")
            lab.cluster("revive-node", victim)
        else:
            lab.cluster("revive-node", victim)
    if code != 0:
        print(f"demo: the faulty run failed with exit code {code}", file=sys.stderr)
        return 1

    diffs = lab.compare_runs(ref.job_dir / "final.pt", run.job_dir / "final.pt")
    ref_ranks, run_ranks = lab.rank_digests(ref.job_dir), lab.rank_digests(run.job_dir)
    differing_ranks = sorted(r for r in set(ref_ranks) | set(run_ranks) if ref_ranks.get(r) != run_ranks.get(r))
    if len(run_ranks) != 4 * g:
        differing_ranks.append(f"{len(run_ranks)} of {4 * g} ranks reported a final state")
    summary = lab.summarize(run.job_dir, fault_at)
    summary.update(weights_identical=not diffs, fault=args.fault, killed_node=victim, lost_ranks=lost, fault_at=fault_at,
                   tasks_per_node=g, world_size=4 * g, ranks_identical=not differing_ranks,
                   differing_ranks=differing_ranks,
                   reference_dir=str(ref.job_dir), job_dir=str(run.job_dir),
                   differing_tensors=diffs[:20])
    print("== recovery timeline (from the fault)")
    print(lab.format_summary(summary, fault_at))
    ck = summary.get("checkpoint", {})
    if "overhead_pct" in ck:
        print(f"== checkpoints: {ck['checkpoints']} on rank 0, mean training stall {ck['mean_stall_ms']} ms, "
              f"{ck['overhead_pct']:.3f}% of training time; {ck['failed']} failed")
    print(f"== final weights {'bit-identical' if not diffs else 'DIFFER: ' + ', '.join(diffs[:5])}"
          " to the fault-free run (model + optimizer state, torch.equal)")
    print(f"== every rank's final state ({len(run_ranks)} ranks, SHA-256 of each): "
          f"{'identical' if not differing_ranks else 'DIFFER: ' + ', '.join(map(str, differing_ranks[:8]))}")
    try:  # the picture needs matplotlib (the test/plot extras): optional
        from slurm_resilience.events import read_events
        from slurm_resilience.inject import read_injections
        from slurm_resilience.timeline_lanes import injected_fault_times
        from slurm_resilience.timeline_plot import plot_timeline

        events = read_events(str(run.job_dir / "events.jsonl"))  # as `slurm-resilience timeline --png` draws it
        png = plot_timeline(events, str(out / "timeline.png"),
                            fault_times=injected_fault_times(events, read_injections(str(run.job_dir))))
        summary["timeline_png"] = png
        print(f"== timeline picture: {png}")
    except ImportError as exc:
        print(f"== no timeline picture ({exc}): pip install matplotlib")
    (out / "demo-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary: {out / 'demo-summary.json'}")
    return 0 if not diffs and not differing_ranks else 1


if __name__ == "__main__":
    sys.exit(main())
