"""The three contenders of benchmarks/lightning_mttr.py, one function each.

Every contender trains the same LightningModule and DataModule (examples/lightning_train*.py:
a tiny MLP, 512 samples, 16 per rank per step) on 2 nodes x 2 ranks, gloo on CPU, one
thread per rank, the same epochs and emulated step time; the fault comes once rank 0 has
reported step ``--kill-at``. MTTR = the fault's wall time → rank 0's first completed step
after the recovery (its progress line: the Resilience callback's ``SR_PROGRESS_FILE``, or
benchmarks/lightning_plain_ckpt.py's ``--progress``, written the same way).

    ours        ``slurm-resilience run`` (2 nodes + 1 spare, warm zygotes with
                ``run.preload: [pytorch_lightning]``, docs/lightning.md) of
                examples/lightning_train.py; the node of ranks 2-3 killed (``lab.kill_node``)
    torchrun    the plain twin under ``torchrun --max-restarts N`` (c10d rendezvous), one
                torchrun agent per node in a plain sbatch job, ModelCheckpoint every step,
                ``fit(ckpt_path="last")``, a fresh c10d store for every restart
                (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; ``--torchrun-store shared`` keeps torch's
                default: the agent's store lives across restarts with the dead attempt's gloo
                addresses in it, and a restarted rank connects to a dead one (``connectFullMesh``
                refused) or waits forever for a peer that connected elsewhere
                (``Pair::waitUntilConnected``); no step within 90 s in 4/4 runs that way);
                the node's training processes SIGKILLed: its two ranks and their DataLoader
                workers, which inherit the ranks' gloo sockets and, left alive, hold them open
                until their parent-death check (``MP_STATUS_CHECK_INTERVAL``, 5 s) while the
                survivors wait in the allreduce; or, with ``--torchrun-kill rank``, only rank 3's
                process (a lone crash: its DataLoader workers live on). The node's agent lives: a
                node loss would take the agent too, and a fixed-size c10d rendezvous cannot
                complete without the node, so this is torchrun's best case
    requeue     the plain twin under srun in a plain sbatch job (Lightning's SLURMEnvironment,
                ``--signal=USR1@90`` as Lightning's docs advise, ``--requeue``), ModelCheckpoint
                every step, ``fit(ckpt_path="last")``; the node of ranks 2-3 killed
                (``lab.kill_node``): Slurm declares it DOWN and requeues the job (JobRequeue),
                which resumes from ``last.ckpt``
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.slurm import commands  # noqa: E402

PLAIN = lab.REPO / "benchmarks" / "lightning_plain_ckpt.py"
OURS = lab.REPO / "examples" / "lightning_train.py"
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}

# The lab's nodes all sit on 127.0.0.1 (MASTER_ADDR, rendezvous and gloo on loopback).
TORCHRUN = """#!/bin/bash
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE={unshared} LOGLEVEL=INFO
srun --kill-on-bad-exit=1 {python} -m torch.distributed.run --nnodes 2 --nproc-per-node 2 \\
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id lmttr-{port} --max-restarts {restarts} \\
  {script} {train}
"""
REQUEUE = """#!/bin/bash
#SBATCH --signal=USR1@90
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$(( {port} + ${{SLURM_RESTART_COUNT:-0}} ))
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
srun {python} {script} {train}
"""


def parse_progress(text: str, attempts: bool) -> list[tuple[int, int, float]]:
    """``(attempt, step, time)`` rows of a progress file: ``ATTEMPT STEP TIME`` lines
    (``attempts``) or the Resilience callback's ``STEP TIME`` (attempt 0). A torn last line
    (being written) is skipped."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        try:
            rows.append((int(parts[0]), int(parts[1]), float(parts[2])) if attempts and len(parts) == 3 else
                        (0, int(parts[0]), float(parts[1])) if not attempts and len(parts) == 2 else None)
        except ValueError:
            continue
        if rows[-1] is None:
            rows.pop()
    return rows


def first_after(rows: list[tuple[int, int, float]], t_fault: float, min_attempt: int) -> tuple[int, float] | None:
    """The first ``(step, time)`` of attempt ``min_attempt`` or later completed after the fault."""
    later = [(t, s) for a, s, t in rows if a >= min_attempt and t > t_fault]
    return (min(later)[1], min(later)[0]) if later else None


def _read(path: Path, attempts: bool = True) -> list[tuple[int, int, float]]:
    return parse_progress(path.read_text(), attempts) if path.exists() else []


def _wait(pred: Callable, what: str, timeout: float, alive: Callable[[], bool] = lambda: True):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if not alive():
            raise RuntimeError(f"ended before {what}")
        time.sleep(0.02)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(args, root: Path) -> list[str]:
    return ["--epochs", str(args.epochs), "--batch", "16", "--step-time", str(args.step_time),
            "--ckpt", str(root / "ckpt"), "--progress", str(root / "progress.txt"), "--pids", str(root / "pids")]


def _sbatch(root: Path, template: str, port: int, args, options: list[str]) -> str:
    script = root / "job.sbatch"
    unshared = int(args.torchrun_store == "fresh")
    script.write_text(template.format(python=sys.executable, port=port, script=PLAIN, restarts=args.max_restarts,
                                      unshared=unshared,
                                      train=" ".join(_train_args(args, root))))
    return commands.sbatch(str(script), [*options, "--output", str(root / "job-%j.out"), "--open-mode=append"])


def _end(job: str, timeout: float) -> None:
    """Wait for the job; cancel it if it outlives ``timeout`` (the lab is shared)."""
    try:
        _wait(lambda: commands.job_state(job) is None, f"job {job} to end", timeout)
    except TimeoutError:
        commands.run(["scancel", job])
        raise


def _result(rows, t_fault: float, min_attempt: int, **extra) -> dict:
    first = first_after(rows, t_fault, min_attempt)
    before = [s for a, s, t in rows if t <= t_fault]
    return {"mttr_s": round(first[1] - t_fault, 3) if first else None, "step_at_fault": max(before, default=None),
            "first_step_after": first[0] if first else None, "last_step": max((s for _, s, _ in rows), default=None),
            **extra}


def run_ours(root: Path, args) -> dict:
    job = root / "job"
    config = root / "config.yaml"
    config.write_text("run:\n  preload: [pytorch_lightning]\n")
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--nodes", "2", "--spares", "1",
            "--tasks-per-node", "2", "--job-dir", str(job), "--config", str(config), "--",
            sys.executable, str(OURS), "--epochs", str(args.epochs), "--batch", "16",
            "--step-time", str(args.step_time), "--out", str(root / "final-{rank}.pt")]
    with open(root / "run.out", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    first = job / "progress-000.log"
    try:
        _wait(lambda: any(s >= args.kill_at for _, s, _ in _read(first, False)), f"step {args.kill_at}", 240,
              lambda: proc.poll() is None)
        victim = json.loads((job / "status.json").read_text())["nodes"][1]
        t_fault = lab.kill_node(victim)  # ---- the timed window starts here
        code = proc.wait(timeout=300)
    except BaseException:
        proc.kill()
        raise
    lab.cluster("revive-node", victim)
    rows = [(0, s, t) for _, s, t in _read(first, False)] + [(1, s, t) for _, s, t in _read(job / "progress-001.log", False)]
    return _result(rows, t_fault, 1, exit_code=code, victim=victim, level="run relaunch on the spare (warm)")


def run_torchrun(root: Path, args) -> dict:
    job = _sbatch(root, TORCHRUN, _free_port(), args,
                  ["--job-name", "lmttr-torchrun", "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "2",
                   "--no-requeue"])
    progress = root / "progress.txt"
    try:
        _wait(lambda: any(s >= args.kill_at for _, s, _ in _read(progress)), f"step {args.kill_at}", 240,
              lambda: commands.job_state(job) is not None)
        ranks = (2, 3) if args.torchrun_kill == "node" else (3,)  # one node's ranks, or its last rank
        pids = [int((root / "pids" / f"rank-{r}").read_text()) for r in ranks]
        if args.torchrun_kill == "node":  # the node's training processes die together, as in a node loss
            pids = [p for pid in pids for p in _tree(pid)]
        t_fault = time.time()  # ---- the timed window starts here
        killed = sum(_kill(pid) for pid in pids)  # processes of the job this benchmark started
        try:
            _wait(lambda: first_after(_read(progress), t_fault, 1), "the first step after the restart",
                  args.recovery_timeout, lambda: commands.job_state(job) is not None)
        except (TimeoutError, RuntimeError) as exc:  # no step again: reported as such, the job cancelled
            commands.run(["scancel", job])
            return {**_result(_read(progress), t_fault, 1), "recovered": False, "why": str(exc), "job": job,
                    "restarts": _restarts(root), "max_restarts": args.max_restarts}
        _end(job, 300)
    except BaseException:
        commands.run(["scancel", job])
        raise
    return _result(_read(progress), t_fault, 1, job=job, recovered=True, restarts=_restarts(root),
                   max_restarts=args.max_restarts, killed_ranks=list(ranks), killed_processes=killed,
                   level="torchrun --max-restarts, last.ckpt")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc/PID/task/TID/children``), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:  # the thread or the process ended meanwhile
                continue
    return out


def _kill(pid: int) -> bool:
    """SIGKILL ``pid``; False if it had already ended (a DataLoader worker can end on its own)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _restarts(root: Path) -> int | None:
    """The worker-group restarts torchrun made (the restart count of the attempt that trained)."""
    rows = _read(root / "progress.txt")
    return max(a for a, _, _ in rows) if rows else None


def run_requeue(root: Path, args) -> dict:
    job = _sbatch(root, REQUEUE, _free_port(), args,
                  ["--job-name", "lmttr-requeue", "--nodes", "2", "--ntasks-per-node", "2", "--requeue"])
    progress = root / "progress.txt"
    try:
        _wait(lambda: any(s >= args.kill_at for _, s, _ in _read(progress)), f"step {args.kill_at}", 240,
              lambda: commands.job_state(job) is not None)
        victim = commands.hostnames(commands.show_job(job)["NodeList"])[1]  # ranks 2-3 (block distribution)
        t_fault = lab.kill_node(victim)  # ---- the timed window starts here
        _wait(lambda: first_after(_read(progress), t_fault, 1), "the first step after the requeue", 300,
              lambda: commands.job_state(job) is not None)
        _end(job, 300)
    except BaseException:
        commands.run(["scancel", job])
        raise
    finally:
        if "victim" in locals():
            lab.cluster("revive-node", victim)
    return _result(_read(progress), t_fault, 1, job=job, victim=victim,
                   level="Slurm requeue on node failure (JobRequeue), last.ckpt")


CONTENDERS: dict[str, Callable[[Path, object], dict]] = {
    "ours": run_ours, "torchrun": run_torchrun, "requeue": run_requeue}
