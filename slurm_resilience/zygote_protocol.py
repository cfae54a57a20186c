"""The zygote's words: typed requests and replies, and the pure decisions behind a warm fork.

A *zygote* (``launch/zygote.py``) is a long-lived process per node that has already
imported torch and the modules of ``run.preload``; the relaunch supervisor asks it to
fork a rank of an unmodified script instead of starting a new ``srun`` step that
would import torch cold. This module is everything both sides must agree on, and
nothing that acts:

* the messages (:class:`Kind`, :class:`ForkRequest`, :class:`Reply`), sent as JSON
  over an authenticated connection (``multiprocessing.connection`` challenge with the
  per-job key, :data:`KEY_FILE`, 0600 in the 0700 job dir);
* :func:`warm_entry` — can this command run warm at all (``python script.py ...``
  with the zygote's own interpreter), and with which ``sys.argv``;
* :func:`task_slurm_vars` / :func:`warm_env` — the environment a cold task of the
  step would have: the zygote's own step environment with the step-specific Slurm
  variables replaced by the relaunch step's, then :func:`rankenv.rank_env`
  (the same code the cold step runs) on top;
* :func:`hosts_store` — the step's first node hosts the rendezvous store (torchrun's
  agent store, :data:`AGENT_STORE_VAR`) in a child forked before its ranks;
* :func:`fork_refusal` — what a fork after import cannot survive (CUDA initialised,
  other threads);
* :func:`step_exit_code` — one code for the step from every rank's, like srun's.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
from typing import Mapping, Sequence

from .rankenv import rank_env


__all__ = [
    "KEY_FILE", "INFO_DIR", "AGENT_STORE_VAR", "STORE_WAIT_S", "STEP_VARS", "Kind", "ForkRequest", "Reply", "encode",
    "decode", "warm_entry", "task_slurm_vars", "warm_env", "hosts_store", "fork_refusal", "step_exit_code"
]


KEY_FILE = "zygote.key"
INFO_DIR = "zygotes"  # job_dir/zygotes/<node>.json: {"addr", "port", "pid"}, written when ready
# torch's env:// rendezvous connects every rank, rank 0 included, as a client to a store
# already listening on MASTER_ADDR:MASTER_PORT (torch/distributed/rendezvous.py
# ``_create_c10d_store``), as under torchrun: the step's node-0 zygote hosts it
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
STORE_WAIT_S = 10.0  # how long node 0's zygote waits for its store host to listen

# Variables slurmstepd sets per step or per task; the zygote's own values describe
# the zygote's one-task step, so they are replaced (or dropped) for a forked rank.
STEP_VARS = (
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES_STEP", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_GTIDS", "SLURM_JOB_NAME",
    "SLURM_NTASKS_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_TASK_PID",
    "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT", "SLURM_STEP_RESV_PORTS",
    "SLURM_CPUS_PER_TASK", "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE",
    "SLURM_CPU_BIND_VERBOSE", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_PRIO_PROCESS", "SLURM_SRUN_COMM_HOST",
)


class Kind(str, enum.Enum):
    """Message kinds. Requests: FORK (start one rank), KILL (SIGKILL every rank this
    connection started, then report them). Replies: FORKED (pid of a started rank),
    REFUSED (one-line reason; nothing was started), EXITED (a rank ended: its code),
    KILLED (every rank of a KILL has been reaped)."""

    FORK = "fork"
    KILL = "kill"
    FORKED = "forked"
    REFUSED = "refused"
    EXITED = "exited"
    KILLED = "killed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForkRequest:
    """One rank of a relaunch step on the zygote's node.

    ``command`` is the user's full command (``python script.py args``); ``log_path``
    the step's log (stdout and stderr of every rank, appended, as srun writes it).
    ``step_nodes`` in Slurm's task order (allocation order); ``node_index`` is this
    node's place in it; ranks are block-distributed, ``tasks_per_node`` per node.
    """

    rank: int
    local_rank: int
    node_index: int
    step_nodes: tuple[str, ...]
    tasks_per_node: int
    step_name: str
    master_addr: str
    master_port: int
    restart: int
    command: tuple[str, ...]
    cwd: str
    umask: int
    log_path: str
    progress_file: str = ""  # the step's SR_PROGRESS_FILE, as a cold task of the step has it
    job_dir: str = ""  # SR_RUN_JOB_DIR (supervisor/executors/relaunch_preempt.py), as a cold task has it


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reply:
    """The zygote's answer: FORKED (``rank``, ``pid``), REFUSED (``reason``), EXITED (``code``) or KILLED."""

    kind: Kind
    rank: int | None = None
    pid: int | None = None
    code: int | None = None
    reason: str = ""


def encode(msg: ForkRequest | Reply | Kind) -> bytes:
    """Pure: one message as JSON bytes (a bare :class:`Kind` is a KILL request)."""
    if isinstance(msg, Kind):
        return json.dumps({"kind": msg.value}).encode()
    body = dataclasses.asdict(msg)
    body["kind"] = Kind.FORK.value if isinstance(msg, ForkRequest) else msg.kind.value
    return json.dumps(body).encode()


def decode(data: bytes) -> ForkRequest | Reply | Kind:
    """Pure: the inverse of :func:`encode`.

    Raises:
        ValueError: not a message of this protocol.
    """
    try:
        body = json.loads(data)
        kind = Kind(body.pop("kind"))
        if kind is Kind.FORK:
            body["step_nodes"], body["command"] = tuple(body["step_nodes"]), tuple(body["command"])
            return ForkRequest(**body)
        if kind is Kind.KILL:
            return kind
        return Reply(kind=kind, **body)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a zygote message: {exc}") from None


def warm_entry(command: Sequence[str], python: str, *, which=shutil.which) -> tuple[str, ...] | None:
    """Pure (but for ``which``): the script's ``sys.argv`` if ``command`` can run warm.

    Warm means ``<python> script.py args...`` where ``<python>`` is the zygote's own
    interpreter (same real path): the zygote then runs ``script.py`` with ``runpy``.
    Anything else (``-m``, interpreter options, another program, another Python, an
    MPI program) returns None and runs cold.
    """
    if len(command) < 2 or command[1].startswith("-"):
        return None
    exe = which(command[0]) if os.sep not in command[0] else command[0]
    if not exe or os.path.realpath(exe) != os.path.realpath(python):
        return None
    return tuple(command[1:])


def task_slurm_vars(req: ForkRequest, *, job_nodelist: str) -> dict[str, str]:
    """Pure: the per-task Slurm variables the relaunch step would give this rank
    (block distribution, ``tasks_per_node`` on each of ``step_nodes``).
    ``job_nodelist``: the step's nodes as a Slurm hostlist."""
    world, nodes, g = len(req.step_nodes) * req.tasks_per_node, len(req.step_nodes), req.tasks_per_node
    first = req.node_index * g
    per_node = f"{g}(x{nodes})" if nodes > 1 else str(g)
    return {
        "SLURM_PROCID": str(req.rank), "SLURM_LOCALID": str(req.local_rank), "SLURM_NODEID": str(req.node_index),
        "SLURM_NTASKS": str(world), "SLURM_NPROCS": str(world), "SLURM_NNODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(world), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NODELIST": job_nodelist,  # SLURM_NODELIST stays the job's, as srun leaves it
        "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": per_node, "SLURM_NTASKS_PER_NODE": str(g),
        "SLURM_GTIDS": ",".join(str(r) for r in range(first, first + g)), "SLURM_JOB_NAME": req.step_name,
    }


def warm_env(zygote_env: Mapping[str, str], req: ForkRequest, *, job_nodelist: str) -> dict[str, str]:
    """Pure: the forked rank's environment, as a cold task of the relaunch step has it.

    The zygote's environment is the cold one (the same supervisor started both steps
    with ``--export=ALL``) plus its own step's variables: those (:data:`STEP_VARS`) are
    replaced by :func:`task_slurm_vars`, then ``rank_env`` adds the torchrun variables
    and ``SR_RESTART`` exactly as ``python -m slurm_resilience.rankenv`` does cold,
    and :data:`AGENT_STORE_VAR` says the rendezvous store is already up (:func:`hosts_store`).
    ``SLURM_STEP_ID``/``SLURM_STEPID``/``SLURM_TASK_PID`` and the srun client's ports are
    left out: no such step exists (docs/restart.md lists every difference).

    Raises:
        ValueError: from ``rank_env`` (an inconsistent request).
    """
    env = {k: v for k, v in zygote_env.items() if k not in STEP_VARS}
    env.update(task_slurm_vars(req, job_nodelist=job_nodelist))
    env["SR_RESTART"] = str(req.restart)
    if req.progress_file:  # the supervisor's srun sets it per relaunch for a cold task
        env["SR_PROGRESS_FILE"] = req.progress_file
    if req.job_dir:
        env["SR_RUN_JOB_DIR"] = req.job_dir
    env.update(rank_env(env, master_addr=req.master_addr, master_port=req.master_port, restart=req.restart))
    env[AGENT_STORE_VAR] = str(True)  # the one variable a cold task lacks: the store is up already
    return env


def hosts_store(req: ForkRequest, *, started: bool) -> bool:
    """Pure: must this zygote start the step's store host before forking ``req``? The
    zygote of the step's first node does, once per step (``started``: it did already),
    before its first rank, so that every rank's ``init_process_group`` finds the store
    listening instead of retrying with back-off until rank 0 would have started it."""
    return req.node_index == 0 and not started


def fork_refusal(*, cuda_initialized: bool, python_threads: int) -> str | None:
    """Pure: why a fork now would give a broken child, or None when it is safe.

    CUDA cannot be used in a child forked after the parent initialised it, and a
    Python thread of the zygote would be missing in the child while holding whatever
    lock it held (torch's own native pools are reset by its at-fork handlers).
    """
    if cuda_initialized:
        return "CUDA is initialised in the zygote: a forked rank could not use the GPU (run cold)"
    if python_threads > 1:
        return f"the zygote runs {python_threads} Python threads: forking it is unsafe (run cold)"
    return None


def step_exit_code(codes: Sequence[int]) -> int:
    """Pure: the step's code from each rank's (``waitstatus_to_exitcode``: -N for signal N):
    0 when all are 0, else the first failure (a signal as 128 + N, as a shell shows it)."""
    for code in codes:
        if code != 0:
            return 128 - code if code < 0 else code
    return 0
