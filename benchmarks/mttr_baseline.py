"""The baselines of benchmarks/mttr.py: what a user without this toolkit does today.

An ordinary torchrun-style script (examples/train_torchrun.py: its own snapshot every
10 steps, resumes from it) is submitted with a plain ``sbatch``; the same fault as the
toolkit's case hits it; the user resubmits the same script by hand and it resumes from
its snapshot. Each baseline has a fault (:data:`FAULTS`), and a case's ratios are taken
only against baselines of its own fault:

    node-kill  baseline-slurm-detection    the job ends when Slurm itself declares the
                                           node DOWN (SlurmdTimeout; 5 s in the lab) and
                                           the job fails; the user resubmits at that
                                           instant (a person watching never does better)
               baseline-instant-detection  the same, with detection granted for free: at
                                           the kill the node is set DOWN and the job
                                           cancelled at once, then resubmitted
    rank-kill  baseline-rank-kill          the last rank SIGKILLed; ``srun
                                           --kill-on-bad-exit=1`` ends the job at once
                                           (Slurm's own detection), then resubmitted
    rank-hang  baseline-hang-instant-detection  the last rank SIGSTOPped; a plain job
                                           notices nothing until its collective timeout
                                           (gloo's default: 30 min), so detection is
                                           granted for free: cancelled at the stop,
                                           resubmitted

The supervisor fault and the frozen node have no baseline: a plain job has no
supervisor, and a job on a frozen node is only ended once the node is back.

MTTR = kill → the resubmitted job's first completed step (rank 0's progress file);
``catch_up_s`` = kill → the step in flight at the kill is done (the steps since the
snapshot are recomputed first; for the toolkit's cases this is their MTTR: they lose at
most the step in flight). Nothing else is in the window: the killed node
stays dead (the job does not need it; the next case's ``reset`` revives it).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.slurm import commands  # noqa: E402

SCRIPT = lab.REPO / "examples" / "train_torchrun.py"
NODES = 4
# baseline -> the fault it suffers (benchmarks/mttr_cases.py's Case.fault)
FAULTS = {"baseline-slurm-detection": "node-kill", "baseline-instant-detection": "node-kill",
          "baseline-rank-kill": "rank-kill", "baseline-hang-instant-detection": "rank-hang"}
BASELINES = tuple(FAULTS)

# The lab's nodes all sit on 127.0.0.1 (MASTER_ADDR and gloo on loopback); on a real
# cluster MASTER_ADDR would be the first host of $SLURM_JOB_NODELIST.
BATCH = """#!/bin/bash
#SBATCH --job-name=mttr-baseline
export MASTER_ADDR=127.0.0.1 MASTER_PORT={port} GLOO_SOCKET_IFNAME=lo
srun --kill-on-bad-exit=1 bash -c 'echo $$ > {pids}/rank-$SLURM_PROCID.pid; \\
  RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec "$0" "$@"' \\
  {python} {script} --steps {steps} --step-time {step_time} --ckpt {ckpt} --out {out} --progress {progress}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(root: Path, args, tag: str) -> str:
    script = root / f"{tag}.sbatch"
    (root / f"pids-{tag}").mkdir(exist_ok=True)  # each rank's pid (bash execs the script: the same pid)
    script.write_text(BATCH.format(port=_free_port(), pids=root / f"pids-{tag}", python=sys.executable,
                                   script=SCRIPT, steps=args.steps,
                                   step_time=args.step_time + getattr(args, "compute_time", 0.0),  # per step, all told
                                   ckpt=root / "ckpt", out=root / "final.pt",
                                   progress=root / f"progress-{tag}.txt"))
    return commands.sbatch(str(script), ["--nodes", str(NODES), "--ntasks-per-node", str(args.tasks_per_node),
                                         "--no-requeue", "--output", str(root / f"{tag}-%j.out")])


def _progress(root: Path, tag: str) -> list[tuple[int, float]]:
    """Rank 0's (step, time) lines of one submission (each job has its own file: the
    first job's survivors may still finish the step in flight after the kill)."""
    path = root / f"progress-{tag}.txt"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(int(r[0]), float(r[1])) for r in rows if len(r) == 2]


def _wait(pred, what: str, timeout: float, poll: float = 0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"baseline: {what} not within {timeout:.0f}s")


def _nodes_of(job_id: str) -> list[str]:
    return commands.hostnames(commands.show_job(job_id)["NodeList"])


def _last_rank_pid(root: Path, tag: str, args) -> int:
    path = root / f"pids-{tag}" / f"rank-{NODES * args.tasks_per_node - 1}.pid"
    return int(_wait(lambda: path.exists() and path.read_text().strip(), f"{path}", 60))


def _inject(name: str, root: Path, job: str, args) -> tuple[float, str]:
    """The baseline's fault (and, with instant detection, its end); returns (wall time
    of the fault, victim)."""
    if FAULTS[name] == "node-kill":
        victim = _nodes_of(job)[1]
        t_fault = lab.kill_node(victim)
        if name == "baseline-instant-detection":
            commands.set_node_state(victim, "down", "mttr baseline: instant detection")
            commands.run(["scancel", job])
        return t_fault, victim
    pid = _last_rank_pid(root, "first", args)  # a process of the job this benchmark submitted
    t_fault = time.time()
    os.kill(pid, signal.SIGKILL if FAULTS[name] == "rank-kill" else signal.SIGSTOP)
    if FAULTS[name] == "rank-hang":  # instant detection: nothing in a plain job would notice
        commands.run(["scancel", job])
    return t_fault, f"rank {NODES * args.tasks_per_node - 1} (pid {pid})"


def run_baseline(name: str, root: Path, args) -> dict:
    """One run of baseline ``name``; ``root``: an empty directory for this run."""
    root.mkdir(parents=True, exist_ok=True)
    lab.cluster("reset")  # outside the window: every node healthy, as for every case
    job = _submit(root, args, "first")
    _wait(lambda: any(s >= args.kill_at for s, _ in _progress(root, "first")), f"step {args.kill_at}", 900)
    in_flight = max(s for s, _ in _progress(root, "first")) + 1
    t_fault, victim = _inject(name, root, job, args)  # ---- the timed window starts here
    _wait(lambda: commands.job_state(job) is None, f"job {job} to end", 120)
    t_ended = time.time()
    second = _submit(root, args, "second")
    t_first = _wait(lambda: next((t for s, t in _progress(root, "second")), None), "the resubmitted job's first step", 900)
    t_caught = _wait(lambda: next((t for s, t in _progress(root, "second") if s >= in_flight), None),
                     "the step in flight at the kill, again", 900)
    _wait(lambda: commands.job_state(second) is None, f"job {second} to end", 900)
    resumed = _progress(root, "second")[0][0] - 1
    final_ok = (root / "final.pt").exists()
    return {"mttr_s": round(t_first - t_fault, 3), "catch_up_s": round(t_caught - t_fault, 3),
            "job_ended_after_s": round(t_ended - t_fault, 3), "step_in_flight": in_flight, "resumed_from_step": resumed,
            "finished": final_ok, "victim": victim, "fault": FAULTS[name], "fault_step": in_flight - 1,
            "level": "sbatch + resubmit by hand + own snapshot" + (" (instant detection)" if "instant" in name
                                                                   else " (Slurm detection)"),
            "tasks_per_node": args.tasks_per_node}


def config_note() -> dict:
    """Slurm's detection settings the slurm-detection baseline ran under."""
    try:
        conf = commands.slurm_config()
    except Exception as exc:  # reported, not fatal: the figures stand without it
        return {"error": str(exc)}
    return {k: conf.get(k) for k in ("SlurmdTimeout", "MessageTimeout", "KillWait")}

