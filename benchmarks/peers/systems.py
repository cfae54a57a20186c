"""The systems of benchmarks/peers.py: how each one launches the same training on the
local Slurm, and the case table (system x fault → a runner, or why it cannot).

Every system trains benchmarks/peers/train.py (torchft: its changed copy train_torchft.py)
on ``--nodes`` nodes x G ranks; the faulted rank is the last one, on the last node.
The peers run from the virtual environments of benchmarks/peers/setup.sh
(``--prefix``). All ranks of all systems reach each other on the first node's
``NodeAddr``; gloo's interface is ``GLOO_SOCKET_IFNAME`` (lo on the loopback lab).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from slurm_resilience.slurm import commands  # noqa: E402

TRAIN = HERE / "train.py"
TRAIN_TORCHFT = HERE / "train_torchft.py"
TRAIN_LIGHTNING = HERE / "train_lightning.py"
SCRIPTS = {"ours": TRAIN, "torchrun": TRAIN, "nvrx": TRAIN, "torchft": TRAIN_TORCHFT, "lightning": TRAIN_LIGHTNING}
SYSTEMS = ("ours", "torchrun", "nvrx", "torchft", "lightning")
FAULTS = ("kill-rank", "kill-node", "freeze-node", "requeue")

# Why a system has no row for a fault (tried, or by construction).
CANNOT: dict[tuple[str, str], str] = {}

HEAD = """#!/bin/bash
export GLOO_SOCKET_IFNAME=${{GLOO_SOCKET_IFNAME:-lo}} OMP_NUM_THREADS=1
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
addr=$(scontrol show node "$head" -o | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
port=$(( {port} + 10 * ${{SLURM_RESTART_COUNT:-0}} ))
"""
# torchrun / NVRx's ft_launcher: one agent per node, c10d rendezvous on the first node.
# --nnodes MIN:MAX lets the survivors go on without a lost node (elastic); the rendezvous
# timeouts are the tightest its docs allow that still start on this box. Workers get a
# fresh store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with the agent's shared
# store a restarted worker may read its peer's address of the round before (gloo: connection
# refused; seen here). The first node's agent hosts the rendezvous store (is_host: on the
# loopback lab every node's address is local, and the store must not sit on the node killed).
AGENTS = HEAD + """export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 {env}
srun --no-kill --kill-on-bad-exit=0 bash -c 'exec {launcher} --nnodes {nnodes} --nproc-per-node {g} \\
  --rdzv-backend c10d --rdzv-endpoint '"$addr:$port"' --rdzv-id peers-$SLURM_JOB_ID --max-restarts {restarts} \\
  --rdzv-conf join_timeout=120,last_call_timeout={last_call},close_timeout=2,keep_alive_interval=1,\\
keep_alive_max_attempt={ka},is_host=$(( SLURM_NODEID == 0 )) --monitor-interval 0.1 {extra} {train}'
"""
# torchft: the lighthouse on the first node, one replica group (a torchrun of G ranks) per node.
TORCHFT = HEAD + """{bin}/torchft_lighthouse --bind "$addr:$port" --min_replicas 1 --quorum_tick_ms 100 \\
  --join_timeout_ms {join_ms} --heartbeat_timeout_ms {hb_ms} &
srun --no-kill --kill-on-bad-exit=0 bash -c 'REPLICA_GROUP_ID=$SLURM_PROCID NUM_REPLICA_GROUPS=$SLURM_NTASKS \\
  TORCHFT_LIGHTHOUSE=http://'"$addr:$port"' TORCHFT_MANAGER_PORT=$(( '"$port"' + 1 + 2 * SLURM_PROCID )) \\
  exec {bin}/python -m torch.distributed.run --nnodes 1 --nproc-per-node {g} --master-addr '"$addr"' \\
  --master-port $(( '"$port"' + 2 + 2 * SLURM_PROCID )) --max-restarts {restarts} --monitor-interval 0.1 {train}'
"""


@dataclass
class Launched:
    """A running training of one system: where its files are and how to stop it."""
    root: Path
    nodes: Callable[[], list[str]]          # the training nodes, in rank order
    job: Callable[[], str | None]           # its Slurm job id
    alive: Callable[[], bool]
    finish: Callable[[float], dict]         # wait for the end (cancel after the timeout); extra results
    info: dict = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.root / "steps.txt"

    @property
    def digest(self) -> Path:
        return self.root / "digest.txt"

    def pid(self, rank: int) -> int:
        return int((self.root / "pids" / f"rank-{rank}").read_text().split()[0])

    def victim_node(self) -> str:
        """The node to fail: that of the highest rank, the first node (the rendezvous store's, the
        lighthouse's, the batch host's) left out; a spare that runs no rank is never chosen."""
        nodes = self.nodes()
        if self.info.get("victim_is_last"):
            return nodes[-1]
        ranked = []
        for f in (self.root / "pids").glob("rank-*"):
            parts = f.read_text().split()
            if len(parts) == 2 and parts[1] != nodes[0]:
                ranked.append((int(f.name.split("-")[1]), parts[1]))
        return max(ranked)[1] if ranked else nodes[-1]


def train_args(root: Path, args, script: Path = TRAIN) -> list[str]:
    return [str(script), "--steps", str(args.steps), "--step-time", str(args.step_time),
            "--snapshot-every", str(args.snapshot_every), "--pg-timeout", str(args.detect),
            "--ckpt", str(root / "ckpt"), "--steplog", str(root / "steps.txt"), "--digest", str(root / "digest.txt"),
            "--pids", str(root / "pids")]


def _sbatch(root: Path, text: str, args, requeue: bool, tasks_per_node: int = 1, spares: int = 0) -> Launched:
    """Submit a plain batch job: ``requeue``: Slurm requeues it when a node fails (or on
    ``scontrol requeue``); else ``--no-kill``: a lost node leaves the job to its survivors."""
    script = root / "job.sbatch"
    script.write_text(text)
    script.chmod(0o700)
    options = ["--job-name", f"peers-{root.name}", "--nodes", str(args.nodes + spares), "--ntasks-per-node",
               str(tasks_per_node), "--cpus-per-task", str(args.g // tasks_per_node), "--output",
               str(root / "job-%j.out"), "--open-mode=append", "--requeue" if requeue else "--no-requeue"]
    if not requeue:
        options.append("--no-kill")
    job = commands.sbatch(str(script), options)

    def nodes() -> list[str]:
        shown = commands.show_job(job) or {}
        return commands.hostnames(shown.get("NodeList", "")) if shown.get("NodeList") not in (None, "(null)") else []

    def finish(timeout: float) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline and commands.job_state(job) is not None and not (root / "digest.txt").exists():
            time.sleep(0.1)
        done = (root / "digest.txt").exists()
        if commands.job_state(job) is not None:
            time.sleep(2 if done else 0)  # the ranks' own teardown, then the job goes
            commands.run(["scancel", job])
        return {"job": job, "finished": done}

    return Launched(root, nodes, lambda: job, lambda: commands.job_state(job) is not None, finish)


def launch_ours(root: Path, args, fault: str) -> Launched:
    job_dir = root / "job"
    config = root / "config.yaml"
    config.write_text(f"detect:\n  heartbeat_timeout_s: {args.detect}\n")
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--config", str(config),
            "--nodes", str(args.nodes), "--spares", "1", "--tasks-per-node", str(args.g), "--job-dir",
            str(job_dir), "--", sys.executable, *train_args(root, args)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    if args.ours_src:  # a tree of slurm_resilience other than the imported one (e.g. a clean export)
        env["PYTHONPATH"] = os.pathsep.join([args.ours_src, *filter(None, [env.get("PYTHONPATH")])])
    with open(root / "run.out", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=args.ours_src or None)

    def status() -> dict:
        try:
            return json.loads((job_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def finish(timeout: float) -> dict:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
            if status().get("job_id"):
                commands.run(["scancel", str(status()["job_id"])])
        return {"exit_code": code, "finished": (root / "digest.txt").exists()}

    return Launched(root, lambda: status().get("nodes", []), lambda: status().get("job_id"),
                    lambda: proc.poll() is None, finish, {"victim_is_last": True})


def _nnodes(args, fault: str) -> str:
    # A lost node's agent never rejoins: only an elastic MIN:MAX can go on without it.
    return f"1:{args.nodes}" if fault in ("kill-node", "freeze-node") else str(args.nodes)


def launch_torchrun(root: Path, args, fault: str) -> Launched:
    text = AGENTS.format(port=args.port, launcher=f"{sys.executable} -m torch.distributed.run", g=args.g,
                         nnodes=_nnodes(args, fault), restarts=args.max_restarts, last_call=args.last_call, extra="", ka=max(1, round(args.detect)), env="",
                         train=" ".join(train_args(root, args)))
    return _sbatch(root, text, args, fault == "requeue")


def launch_nvrx(root: Path, args, fault: str) -> Launched:
    """NVRx 0.7's hot spares: ``--nnodes N:N+1`` on N+1 nodes, N active, one standby that takes
    a lost node's place (the same spare ours gets)."""
    bin_dir = Path(args.prefix) / "nvrx" / "bin"
    text = AGENTS.format(port=args.port, launcher=f"{bin_dir}/ft_launcher", g=args.g,
                         nnodes=f"{args.nodes}:{args.nodes + 1}",
                         restarts=args.max_restarts, last_call=args.last_call, ka=max(1, round(args.detect)),
                         extra="--ft-ignore-missing-cfg",
                         # the lab's nodes all call themselves localhost: NVRx would take them for one node
                         env="NVRX_ENABLE_MULTI_LAUNCHERS_PER_NODE=1", train=" ".join(train_args(root, args)))
    return _sbatch(root, text, args, fault == "requeue", spares=1)


def launch_torchft(root: Path, args, fault: str) -> Launched:
    bin_dir = Path(args.prefix) / "torchft" / "bin"
    text = TORCHFT.format(port=args.port, bin=bin_dir, g=args.g, restarts=args.max_restarts,
                          join_ms=int(args.join_ms), hb_ms=int(args.detect * 1000), train=" ".join(train_args(root, args, TRAIN_TORCHFT)))
    return _sbatch(root, text, args, fault == "requeue")


# Lightning on Slurm without torchrun: srun starts every rank, SLURMEnvironment, the job
# requeued by Slurm when a node fails (JobRequeue, --requeue) and resumed from last.ckpt.
LIGHTNING_SRUN = HEAD + """export MASTER_ADDR=$addr MASTER_PORT=$port
srun {python} {train}
"""


def launch_lightning(root: Path, args, fault: str) -> Launched:
    python = Path(args.prefix) / "lightning" / "bin" / "python"
    train = " ".join(train_args(root, args, TRAIN_LIGHTNING))
    if fault in ("kill-rank", "none"):  # Lightning's in-job restart is torchrun's (--max-restarts)
        text = AGENTS.format(port=args.port, launcher=f"{python} -m torch.distributed.run", g=args.g,
                             nnodes=str(args.nodes), restarts=args.max_restarts, last_call=args.last_call,
                             ka=max(1, round(args.detect)), env="", extra="", train=train)
        return _sbatch(root, text, args, False)
    return _sbatch(root, LIGHTNING_SRUN.format(port=args.port, python=python, train=train), args, True, args.g)


LAUNCHERS: dict[str, Callable[[Path, object, str], Launched]] = {
    "ours": launch_ours, "torchrun": launch_torchrun, "nvrx": launch_nvrx, "torchft": launch_torchft,
    "lightning": launch_lightning}
