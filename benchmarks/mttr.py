#!/usr/bin/env python3
"""MTTR per recovery level on the local cluster, against a job-level baseline.

Each case submits examples/train_mlp.py (4 worker nodes x --tasks-per-node ranks),
injects one fault once every rank has done --kill-at steps, and reads the job's
event log (every case, the baseline included, runs with the same G, steps and
kill step; a killed node takes all G ranks of rank 1's node with it):
MTTR = fault injection → first completed step after recovery (the last rank's).

    online            rank SIGKILLed on a healthy node → restarted in place
    node-replacement  node killed, warm spare adopts the rank
    scale-in          node killed, no spare: 3 ranks continue
    process-restart   node killed, online recovery forced to time out → all relaunched
    requeue           node killed, no spare, scale-in off → scontrol requeue
    supervisor        the supervisor SIGKILLed → the batch step restarts it and it
                      re-attaches (MTTR = kill → re-attached; training never pauses)
    baseline          node killed → scancel + sbatch a new job that restores from the
                      last L2 checkpoint (what a job without this toolkit does, with
                      instant detection granted to it)

    run-cold/run-warm `slurm-resilience run` of the unmodified examples/train_torchrun.py
                      (3 nodes + 1 spare), a worker node killed after its first
                      snapshot, relaunched cold (`run.warm: false`: a new srun step
                      imports torch) or warm (forked by the per-node zygotes):
                      MTTR = kill → rank 0's first step of the relaunched program,
                      its own snapshot load included

Needs the cluster: scripts/local-cluster start; eval "$(scripts/local-cluster env)".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.events import read_events  # noqa: E402
from slurm_resilience.protocol import EventKind, WorkerEvent  # noqa: E402
from slurm_resilience.slurm import commands  # noqa: E402

CASES = {
    "online": ("", "rank", 1),
    "node-replacement": ("", "node", 1),
    "scale-in": ("", "node", 0),
    "process-restart": ("recovery:\n  online_timeout_s: 0.005\n", "node", 1),
    "requeue": ("recovery:\n  scale_in: false\n  max_requeues: 1\n", "node", 0),
    "supervisor": ("", "supervisor", 1),
}


def config(tmp: Path, name: str, extra: str) -> Path:
    p = tmp / f"{name}.yaml"
    p.write_text(lab.LOCAL_CONFIG.read_text() + extra)
    return p


def first_step_after(events: list[dict], t: float) -> float | None:
    """When the last rank of the first world formed after ``t`` completed its first step."""
    after = [e for e in events if e["kind"] == WorkerEvent.FIRST_STEP.logged and e["t"] > t]
    if not after:
        return None
    first = min(after, key=lambda e: e["t"])
    same = [e["t"] for e in after if e.get("generation") == first.get("generation")
            and abs(e["t"] - first["t"]) < 60]
    return max(same)


def run_case(name: str, root: Path, args) -> dict:
    extra, fault, spares = CASES[name]
    lab.cluster("reset")
    run = lab.submit(root / name, spares=spares, tasks_per_node=args.tasks_per_node, steps=args.steps,
                     config=config(root, name, extra))
    status = run.wait_for_step(args.kill_at)
    if fault in ("rank", "supervisor"):
        t_fault = time.time()
        os.kill(status["ranks"][1]["pid"] if fault == "rank" else status["supervisor_pid"], signal.SIGKILL)
    else:
        t_fault = lab.kill_node(status["ranks"][1]["node"])
    code = run.wait()
    events = read_events(str(run.job_dir / "events.jsonl"))
    done = [e for e in events if e["kind"] == EventKind.RECOVERY_DONE]
    out = {"exit_code": code, "tasks_per_node": args.tasks_per_node}
    back = [e for e in events if e["kind"] == EventKind.SUPERVISOR_REATTACHED]
    if fault == "supervisor" and back:
        out["mttr_s"] = round(back[0]["t"] - t_fault, 3)
        out["level"] = "supervisor re-attach"
        out["recoveries"] = len(done)
    elif done:
        out["mttr_s"] = round(done[0]["first_step"] - t_fault, 3)
        out["level"] = done[0]["level"]
        out["phases_ms"] = {e["phase"]: e["duration_ms"] for e in events
                            if e["kind"] == EventKind.PHASE and e["recovery"] == done[0]["recovery"]}
    else:  # requeue: the restarted job's first step
        t_first = first_step_after(events, t_fault)
        out["mttr_s"] = round(t_first - t_fault, 3) if t_first else None
        out["level"] = "requeue" if any(e["kind"] == EventKind.REQUEUE for e in events) else "?"
    return out


def baseline(root: Path, args) -> dict:
    """Kill a node, cancel the job at once, resubmit, restore from the shared checkpoint."""
    lab.cluster("reset")
    shared = root / "baseline-shared"
    cfg = config(root, "baseline", f"  shared_dir: {shared}\nrecovery:\n  scale_in: false\n  max_requeues: 0\n")
    run = lab.submit(root / "baseline-1", spares=0, tasks_per_node=args.tasks_per_node, steps=args.steps,
                     config=cfg)
    status = run.wait_for_step(args.kill_at)
    t_fault = lab.kill_node(status["ranks"][1]["node"])
    commands.run(["scancel", status["job_id"]])
    run.wait()
    lab.cluster("reset")
    second = lab.submit(root / "baseline-2", spares=0, tasks_per_node=args.tasks_per_node, steps=args.steps,
                        config=cfg)
    assert second.wait() == 0, second.output()
    events = read_events(str(second.job_dir / "events.jsonl"))
    t_first = first_step_after(events, t_fault)
    restored = [e for e in events if e["kind"] == WorkerEvent.RESTORED.logged and e.get("tier")]
    return {"mttr_s": round(t_first - t_fault, 3), "restored_step": restored[0]["step"] if restored else None,
            "level": "cancel + resubmit + restore (L2)", "tasks_per_node": args.tasks_per_node}


def run_relaunch(root: Path, args, *, warm: bool) -> dict:
    """`slurm-resilience run` relaunch of an unmodified script: kill a worker node once
    the first snapshot exists; MTTR = kill → the relaunched rank 0's first step."""
    import subprocess

    try:
        lab.cluster("reset")
    except RuntimeError as exc:  # a node held by a job that is not ours: this case revives its own victim
        print(f"warning: {exc}", file=sys.stderr)
    job = root / f"run-{'warm' if warm else 'cold'}"
    job.mkdir(parents=True)
    (job / "config.yaml").write_text(f"run:\n  warm: {str(warm).lower()}\n")
    stamps = job / "stamps.txt"
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--config", str(job / "config.yaml"),
            "--nodes", "3", "--spares", "1", "--job-dir", str(job / "job"), "--", sys.executable,
            str(lab.REPO / "examples" / "train_torchrun.py"), "--steps", str(args.steps), "--ckpt", str(job / "ckpt"),
            "--out", str(job / "final.pt"), "--stamps", str(stamps)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    deadline = time.time() + 180
    while not (job / "ckpt" / "snapshot.pt").exists():
        assert time.time() < deadline and proc.poll() is None, "no snapshot"
        time.sleep(0.02)
    victim = json.loads((job / "job" / "status.json").read_text())["nodes"][1]
    t_fault = lab.kill_node(victim)
    code = proc.wait(timeout=300)
    lab.cluster("revive-node", victim)
    lines = [ln.split() for ln in stamps.read_text().splitlines()] if stamps.exists() else []
    after = [float(t) for restart, _, t in lines if int(restart) >= 1 and float(t) > t_fault]
    return {"exit_code": code, "mttr_s": round(min(after) - t_fault, 3) if after else None,
            "level": f"run relaunch ({'warm: zygote fork' if warm else 'cold: new srun step'})"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=25)
    ap.add_argument("--cases", default=",".join([*CASES, "baseline"]))
    ap.add_argument("--tasks-per-node", type=int, default=1, metavar="G",
                    help="ranks per worker node, for every case alike (G <= the local cluster's CPUs per node)")
    ap.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="runs of every case alike (interleaved: case a, b, ..., then again); median/min/max")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.tasks_per_node < 1:
        ap.error(f"--tasks-per-node={args.tasks_per_node} must be >= 1")
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="mttr-"))
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):  # interleaved, so a slow spell of the box hits every case alike
        for name in args.cases.split(","):
            case_root = root / f"r{rep}"
            case_root.mkdir(exist_ok=True)
            if name in ("run-cold", "run-warm"):
                r = run_relaunch(case_root, args, warm=name == "run-warm")
            else:
                r = baseline(case_root, args) if name == "baseline" else run_case(name, case_root, args)
            runs.setdefault(name, []).append(r)
            print(f"{name:<18} run {rep + 1}/{args.repeats} {json.dumps(r)}", flush=True)
    results = {}
    for name, rs in runs.items():
        ms = sorted(r["mttr_s"] for r in rs if r.get("mttr_s") is not None)
        results[name] = {**rs[-1], "runs": rs, "mttr_s": statistics.median(ms) if ms else None,
                         "mttr_min_s": ms[0] if ms else None, "mttr_max_s": ms[-1] if ms else None}
    base = results.get("baseline", {}).get("mttr_s")
    print(f"\n{'level':<18}{'median (s)':>11}{'min':>8}{'max':>8}{'vs baseline':>14}   (G={args.tasks_per_node}, "
          f"{args.repeats} run(s) each)")
    for name, r in results.items():
        m = r.get("mttr_s")
        ratio = f"{base / m:10.1f}x" if base and m else ""
        nan = float("nan")
        print(f"{name:<18}{m if m is not None else nan:>11.3f}{r['mttr_min_s'] or nan:>8.3f}"
              f"{r['mttr_max_s'] or nan:>8.3f}{ratio:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
