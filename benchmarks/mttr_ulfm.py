"""The MPI cases of benchmarks/mttr.py: the in-place path (ULFM) against the relaunch
path, both through `slurm-resilience run --mpi`: 3 worker nodes x G ranks + 1 spare
node, the same steps, the fault once rank 0 has done --kill-at steps.

    ulfm-rank           examples/mpi_ulfm_train.py (Session) under the bundled Open MPI 5,
                        world rank 1 SIGKILLed: a spare rank takes it in place; MTTR = kill
                        -> the first step rank 0 completes after the repair (`first_step`)
    ulfm-node           the same program, rank 1's node killed (its ranks and its prted):
                        PRRTE ends the job, the supervisor relaunches mpirun with the spare
                        node in its place; MTTR = kill -> the relaunched program's first step
    ulfm-frozen         the same program, rank 1's node frozen (slurmd stopped, its processes
                        frozen, nothing closed): the supervisor finds its beat files quiet and
                        its slurmd silent, ends mpirun and relaunches with the spare node;
                        MTTR = freeze -> the relaunched program's first step
    mpi-relaunch-node   examples/mpi_train.py (plain mpi4py) on Debian's Open MPI 4.1, the
                        relaunch path (`srun --mpi=pmix`), rank 1's node killed; MTTR = kill
                        -> the relaunched program's first step (its SR_PROGRESS_FILE line)
    mpi-relaunch-rank   the relaunch path with MPI rank 1 SIGKILLed on a healthy node: the
                        step runs under `srun --kill-on-bad-exit=1`, so Slurm ends it (the
                        survivors would block in their Allreduce), the supervisor relaunches
                        it in place; MTTR = kill -> the relaunched program's first step;
                        given up 60 s after the kill
    mpi-relaunch-hang   the relaunch path with MPI rank 1 SIGSTOPped: nothing exits, the
                        step's progress lines stop, and past the hard step timeout
                        (detect.progress_hard_s, 20 s by default) the supervisor cancels the
                        step and relaunches it in place; MTTR = stop -> the relaunched
                        program's first step

Every MTTR includes the restarted program's snapshot load where there is a relaunch.

Needs the cluster and the ULFM venv (scripts/install-deps.sh).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.mpi.launch import DEFAULT_VENV  # noqa: E402

VENV = os.environ.get("SR_ULFM_VENV", DEFAULT_VENV)
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,tcp",
       "PYTHONPATH": str(lab.REPO)}


def _steps_done(progress: Path) -> int:
    try:
        lines = progress.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return int(lines[-1].split()[0]) if lines else -1


def _wait(pred, proc: subprocess.Popen, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"run ended ({proc.returncode}) before {what}")
        time.sleep(0.02)
    raise RuntimeError(f"no {what} within {timeout} s")


def _rank1_pid_plain(marker: str) -> int | None:
    """The process of MPI rank 1 of the plain program (its argv holds ``marker``)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if marker.encode() not in argv or b"mpi_train.py" not in b" ".join(argv):
                continue
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"PMIX_RANK") == b"1" or env.get(b"OMPI_COMM_WORLD_RANK") == b"1":
            return int(d.name)
    return None


def _ulfm_start(ev_dir: Path, wid: int) -> dict | None:
    for f in ev_dir.glob(f"events-w{wid}.jsonl"):
        for ln in f.read_text().splitlines():
            rec = json.loads(ln)
            if rec["kind"] == "start":
                return rec
    return None


def _ulfm_rank1_pid(ev_dir: Path) -> int | None:
    rec = _ulfm_start(ev_dir, 1)
    return None if rec is None else int(rec["pid"])


def _ulfm_rank1_node(ev_dir: Path) -> str:
    rec = _ulfm_start(ev_dir, 1)
    if rec is None:
        raise RuntimeError("rank 1 has not started")
    return rec["node"]


def _cancel_own_job(job: Path) -> None:
    """scancel the job this case submitted (its id is in the supervisor's events)."""
    try:
        first = json.loads((job / "events.jsonl").read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return
    job_id = str(first.get("job_id", ""))
    if job_id.isdigit():
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def run_mpi_case(name: str, root: Path, args) -> dict:
    """One run of ``name`` (one of ``MPI_CASES``); returns its record."""
    try:
        lab.cluster("reset")
    except RuntimeError as exc:  # a node held by a job that is not ours: this case revives its own victim
        print(f"warning: {exc}", file=sys.stderr)
    job = root / "job"
    ulfm, frozen = name.startswith("ulfm-"), name == "ulfm-frozen"
    node = name.endswith("-node") or frozen
    give_up = 60.0 if name in ("mpi-relaunch-rank", "mpi-relaunch-hang") else 300.0
    sig = signal.SIGSTOP if name.endswith("-hang") else signal.SIGKILL
    if ulfm:
        program = [os.path.join(VENV, "bin", "python"), str(lab.REPO / "examples" / "mpi_ulfm_train.py"),
                   "--out", str(root / "final.npz"), "--snapshot", str(root / "snap")]
    else:
        program = [sys.executable, str(lab.REPO / "examples" / "mpi_train.py"), "--ckpt", str(root / "ckpt"),
                   "--out", str(root / "final.npy")]
    program += ["--steps", str(args.steps), "--step-time", str(args.step_time)]
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--mpi", "--nodes", "3", "--spares", "1",
            "--tasks-per-node", str(args.tasks_per_node), "--job-dir", str(job), "--", *program]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV})
    try:
        _wait(lambda: _steps_done(job / "progress-000.log") >= args.kill_at, proc, 180, f"step {args.kill_at}")
        victim = None
        if node:
            victim = _ulfm_rank1_node(job / "ulfm-000") if ulfm else \
                json.loads((job / "status.json").read_text())["nodes"][1]
            t_kill = lab.freeze_node(victim) if frozen else lab.kill_node(victim)
        else:
            pid = _ulfm_rank1_pid(job / "ulfm-000") if ulfm else _rank1_pid_plain(str(root / "ckpt"))
            if pid is None:
                raise RuntimeError("rank 1's process not found")
            t_kill = time.time()
            os.kill(pid, sig)  # a rank of the job this benchmark started (its step kills a stopped one)
        try:
            code = proc.wait(timeout=give_up)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        if proc.poll() is None:
            proc.kill()  # the `run --wait` client this benchmark started
            _cancel_own_job(job)
        if node and victim:
            if frozen:
                lab.thaw_and_revive(victim)
            else:
                lab.cluster("revive-node", victim)
    output = proc.stdout.read()
    path = [ln.replace(sys.executable, os.path.basename(sys.executable)).replace(str(lab.REPO), ".")
            for ln in output.splitlines() if ln.startswith("MPI recovery path:")]  # no path of this machine
    if code is None:
        return {"exit_code": None, "mttr_s": None, "level": f"no recovery within {give_up:.0f} s of the kill",
                "path_line": path[0] if path else None}
    if ulfm and not node:
        first = [r for f in (job / "ulfm-000").glob("events-w*.jsonl") for r in map(json.loads, f.read_text().splitlines())
                 if r["kind"] == "first_step" and r["rank"] == 0 and r["t"] > t_kill]
        t_back = min((r["t"] for r in first), default=None)
        level = "in place (ULFM): a spare rank takes rank 1, no process started"
    else:
        lines = [ln.split() for ln in (job / "progress-001.log").read_text().splitlines()] \
            if (job / "progress-001.log").exists() else []
        t_back = float(lines[0][1]) if lines else None
        level = ("node frozen: found silent, mpirun ended and relaunched with the spare node" if frozen else
                 "node lost: mpirun relaunched with the spare node (PRRTE ended the job)" if ulfm else
                 "relaunch of the whole step (srun --mpi=pmix) on the spare node" if node else
                 "step ended by srun --kill-on-bad-exit=1, relaunched in place" if sig is signal.SIGKILL else
                 "progress lines stopped past the hard step timeout, step cancelled and relaunched in place"
                 ) + ", resumed from the snapshot"
    return {"exit_code": code, "mttr_s": round(t_back - t_kill, 3) if t_back else None, "level": level,
            "path_line": path[0] if path else None}


MPI_FAULTS = {"ulfm-rank": "rank-kill", "ulfm-node": "node-kill", "ulfm-frozen": "node-freeze",
              "mpi-relaunch-node": "node-kill",
              "mpi-relaunch-rank": "rank-kill", "mpi-relaunch-hang": "rank-hang"}
"""Each MPI case's fault (``mttr.fault_of``)."""
MPI_CASES = tuple(MPI_FAULTS)
