#!/usr/bin/env python3
"""MTTR per fault and recovery level on the local cluster, against same-fault baselines run alongside.

Each case (benchmarks/mttr_cases.py) submits examples/train_mlp.py (4 worker nodes
x --tasks-per-node ranks), injects one fault once every rank has done --kill-at
steps, and reads the job's event log. MTTR = fault injection → first completed step
after recovery (the last rank's). Cases:

    kill-node         a worker node killed (rank 1's), warm spare adopts its ranks
    rank0-node        rank 0's node killed
    kill-rank         the last rank SIGKILLed on a healthy node → restarted in place (online):
                      its node's warm standby adopts the slot (recovery.local_standbys)
    kill-rank-cold    the same with recovery.local_standbys off: a new process imports torch
    hang-rank         the last rank SIGSTOPped → heartbeat stale → recovered
    hang-main         the last rank's main thread blocks on a lock (heartbeat and pulse alive)
                      → hung after the blocking timeout (its peers all wait) → restarted in place
    scale-in          node killed, no spare: the others continue
    process-restart   node killed, online recovery forced to time out → all relaunched;
                      each node's warm standbys take its slots (recovery.local_standbys_per_node
                      of them, 1 by default), the former spare's extra ones included
    process-restart-all   the same with recovery.local_standbys_per_node: all (a standby for
                      every slot of a node; differs from process-restart with --tasks-per-node > 1)
    process-restart-cold  the same with recovery.local_standbys off: every rank starts cold
    requeue           node killed, no spare, scale-in off → scontrol requeue
    requeue-resubmit  the same with recovery.requeue_by: resubmit (a new job id, same job dir)
    supervisor        the supervisor SIGKILLed → restarted, re-attaches (training never pauses)
    freeze-node       a node frozen (slurmd and its job cgroups stopped: nothing closes) →
                      classified lost by the slurmd probe → the spare adopts its ranks
    kill-node-podman  kill-node with every rank and standby in a podman container
    partition-node    rank 1's node cut from everyone by iptables (its processes run on, no FIN)
                      → lost → the spare adopts its ranks
    partition-peers   rank 1's node cut from the other ranks' nodes only (slurmctld and the
                      supervisor, on a node of its own, still reach it) → the pulses' peer
                      probes blame it (NODE_PARTITIONED) → the spare adopts its ranks
    partition-supervisor rank 1's node cut from the supervisor's store and liveness ports
                      only (its peers and slurmctld still reach it) → silent, its slurmd
                      answers, its peers reach its pulse → NODE_PARTITIONED → the spare
    flap-node         rank 1's node cut for 0.5 s, then back: no recovery; the window ends
                      when every rank has passed its step at the heal (status.json, 0.5 s)

Baselines (benchmarks/mttr_baseline.py): the ordinary torchrun-style script
examples/train_torchrun.py under a plain sbatch, resubmitted by hand after the kill,
resuming from its own snapshot; with Slurm's own detection, and with instant detection.

Baselines of the other faults (a rank SIGKILLed, a rank hung) hit the same plain job
the same way; a case's ratios are taken only against the baselines of its own fault
(``Case.fault``; the supervisor and frozen-node cases have none).

Every contender, case or baseline, runs the same --steps and is hit once every rank has
done --kill-at steps (the standby cases also wait for their standbys, connected well
before the default --kill-at; each run reports its ``fault_step``). Every case runs
--repeats times (interleaved: a slow spell of the box hits all alike); median, min and
max are printed with the ratio of each same-fault baseline's median to the case's
median, and everything goes to --json (default mttr.json).

Every step takes the same emulated time in every contender: --compute-time (default
0.05 s) inside the toolkit's step, before its all-reduce, where a model's forward and
backward are (an aborted step skips it), and --step-time (default 0) after it; the
baselines sleep both per step. Before 2026-11-28 the 0.05 s was --step-time, after the
step: each survivor of a fault slept it out before it recovered.

    run-cold/run-warm `slurm-resilience run` of the unmodified examples/train_torchrun.py
                      (3 nodes + 1 spare), a worker node killed after its first
                      snapshot, relaunched cold (`run.warm: false`: a new srun step
                      imports torch) or warm (forked by the per-node zygotes):
                      MTTR = kill → rank 0's first step of the relaunched program,
                      its own snapshot load included

    ulfm-rank / mpi-relaunch-rank   an MPI program with one rank SIGKILLed, through
                      `slurm-resilience run --mpi`: repaired in place (ULFM, a spare rank)
                      vs the relaunch path (srun --mpi=pmix, Debian's Open MPI); run them
                      together (--cases ulfm-rank,mpi-relaunch-rank): benchmarks/mttr_ulfm.py;
                      mpi-relaunch-hang: rank 1 SIGSTOPped on the relaunch path

Needs the cluster: scripts/local-cluster start; eval "$(scripts/local-cluster env)".
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mttr_baseline import BASELINES, FAULTS, config_note, run_baseline  # noqa: E402
from mttr_cases import CASES, run_case  # noqa: E402
from mttr_run import RUN_CASES, run_relaunch  # noqa: E402
from mttr_ulfm import MPI_CASES, MPI_FAULTS, run_mpi_case  # noqa: E402
from provenance import stamped  # noqa: E402


def stats(values: list[float]) -> dict:
    v = sorted(values)
    return {"median_s": round(statistics.median(v), 3), "min_s": v[0], "max_s": v[-1], "n": len(v)} if v else \
        {"median_s": None, "min_s": None, "max_s": None, "n": 0}


def fault_of(name: str) -> str:
    """The fault a case or baseline suffers (its ratios are only against this fault's baselines)."""
    if name in FAULTS:
        return FAULTS[name]
    if name in CASES:
        return CASES[name].fault
    return MPI_FAULTS.get(name, "node-kill")  # the run-* cases kill a node


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per case: median/min/max of MTTR (and of catch-up for the baselines); the ratio of
    each baseline of the case's own fault to the case's median ("baseline takes Nx as long")."""
    out = {name: {**stats([r["mttr_s"] for r in rs if r.get("mttr_s") is not None]), "runs": rs}
           for name, rs in runs.items()}
    for name in BASELINES:
        if name in out:
            out[name]["catch_up"] = stats([r["catch_up_s"] for r in runs[name] if r.get("catch_up_s") is not None])
    for name, r in out.items():
        r["fault"] = fault_of(name)
        r["fault_steps"] = sorted({x["fault_step"] for x in r["runs"] if x.get("fault_step") is not None})
        r["ratio"] = {b: round(out[b]["median_s"] / r["median_s"], 2) for b in BASELINES
                      if b in out and FAULTS[b] == r["fault"] and out[b]["median_s"] and r["median_s"]}
    return out


def table(results: dict[str, dict], args) -> str:
    nan = float("nan")
    lines = [f"{'case':<34}{'fault':<16}{'median (s)':>11}{'min':>8}{'max':>8}{'n':>3}   "
             f"same-fault baseline / case   (G={args.tasks_per_node}, {args.repeats} repeat(s))"]
    for name, r in results.items():
        ratios = ", ".join(f"{b.removeprefix('baseline-')} {x:.1f}x" for b, x in r["ratio"].items()) or "-"
        lines.append(f"{name:<34}{r.get('fault', fault_of(name)):<16}"
                     f"{r['median_s'] if r['median_s'] is not None else nan:>11.3f}"
                     f"{r['min_s'] if r['min_s'] is not None else nan:>8.3f}"
                     f"{r['max_s'] if r['max_s'] is not None else nan:>8.3f}{r['n']:>3}   {ratios}")
    for b in BASELINES:
        if b in results and results[b]["catch_up"]["n"]:
            c = results[b]["catch_up"]
            lines.append(f"  {b}: back at the step of the fault after {c['median_s']:.3f} s "
                         f"(min {c['min_s']:.3f}, max {c['max_s']:.3f}): the steps since its snapshot are redone")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of every contender")
    ap.add_argument("--kill-at", type=int, default=120,
                    help="the fault once every rank has done this many steps, for every contender "
                         "(late enough for the standbys to connect)")
    ap.add_argument("--compute-time", type=float, default=0.05,
                    help="emulated compute per step (s) inside the step, before its all-reduce, as a model's "
                         "forward/backward (the toolkit's cases: examples/train_mlp.py --compute-time)")
    ap.add_argument("--step-time", type=float, default=0.0,
                    help="emulated work per step (s) after the step (logging, evaluation: an aborted step's rank "
                         "does it before it recovers); the baselines sleep --compute-time + --step-time per step")
    ap.add_argument("--cases", default=",".join([*CASES, *BASELINES]),
                    help=f"comma-separated, of: {', '.join([*CASES, *RUN_CASES, *MPI_CASES, *BASELINES])} "
                         "(default: all but the run-* and MPI cases)")
    ap.add_argument("--tasks-per-node", type=int, default=1, metavar="G",
                    help="ranks per worker node, for every case alike (G <= the local cluster's CPUs per node)")
    ap.add_argument("--repeats", type=int, default=5, metavar="N", help="runs of every case (interleaved)")
    ap.add_argument("--json", default="mttr.json", help="write the results here (default: %(default)s)")
    args = ap.parse_args()
    names = [n for n in args.cases.split(",") if n]
    known = [*CASES, *RUN_CASES, *MPI_CASES, *BASELINES]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    if args.tasks_per_node < 1 or args.repeats < 1 or not 0 < args.kill_at < args.steps:
        ap.error("need --tasks-per-node >= 1, --repeats >= 1 and 0 < --kill-at < --steps")
    root = Path(tempfile.mkdtemp(prefix="mttr-"))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):  # interleaved, so a slow spell of the box hits every case alike
        for name in names:
            case_root = root / f"r{rep}" / name
            case_root.mkdir(parents=True, exist_ok=True)
            try:
                if name in RUN_CASES:
                    r = run_relaunch(case_root, args, warm=RUN_CASES[name])
                elif name in MPI_CASES:
                    r = run_mpi_case(name, case_root, args)
                else:
                    r = run_baseline(name, case_root, args) if name in BASELINES else run_case(CASES[name], case_root, args)
            except Exception as exc:  # one failed run is reported, the others still run
                r = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=3)}
            runs.setdefault(name, []).append(r)
            print(f"{name:<28} run {rep + 1}/{args.repeats} {json.dumps({k: v for k, v in r.items() if k != 'trace'})}",
                  flush=True)
    results = summarize(runs)
    print("\n" + table(results, args))
    doc = {"benchmark": "mttr", "started": started, "machine": platform.node(), "cpus": _cpus(),
           "args": vars(args), "slurm": config_note(), "work_dir": str(root), "results": results}
    Path(args.json).write_text(json.dumps(stamped(doc, __file__), indent=2))
    print(f"\nwrote {args.json}")
    return 0


def _cpus() -> int | None:
    import os

    return os.cpu_count()


if __name__ == "__main__":
    sys.exit(main())
