"""The wire contract between the supervisor and the worker sessions.

Both sides meet in the supervisor's TCPStore under a per-job secret prefix and on
the supervisor's liveness socket. Everything a side reads or writes is named here,
so the two halves cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Mapping

from .model import RankTable


__all__ = [
    "PlanAction", "Plan", "StoreKey", "EventKind", "WorkerEvent", "RecoveryPhase", "Role", "WorkerEnv",
    "TOKEN_FILE", "write_token", "read_token", "RUN_JOB_DIR_VAR", "PREEMPT_REQUEST_FILE", "preempt_request_path"
]


class PlanAction(enum.Enum):
    """What the ranks of a generation do.

    RUN: build the generation's process group, restore, continue training.
    ABORT: recovery is impossible; survivors persist their state and exit non-zero.
    STOP: the job is being requeued; survivors exit, the requeued job resumes from
        the newest committed checkpoint.
    PERSIST: preemption. The ranks re-form (same table, new generation), agree on
        the newest step exactly as online recovery does, write every durable tier
        and exit 0; the requeued job resumes from that step.
    """

    RUN = "run"
    ABORT = "abort"
    STOP = "stop"
    PERSIST = "persist"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A generation as published by the supervisor (``plan/{generation}``)."""

    generation: int
    action: PlanAction
    table: RankTable
    joining: tuple[int, ...] = ()
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "action": self.action.value,
                "table": self.table.to_wire(),  # compact: every rank reads it
                "joining": list(self.joining),
                "reason": self.reason,
            },
            sort_keys=True, separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        d = json.loads(text)
        return cls(
            generation=int(d["generation"]),
            action=PlanAction(d["action"]),
            table=RankTable.from_wire(d["table"]) if "g" in d["table"] else RankTable.from_dict(d["table"]),
            joining=tuple(int(r) for r in d["joining"]),
            reason=str(d.get("reason", "")),
        )


class _Named(str, enum.Enum):
    """A closed set of names that travel as plain strings (JSON, store keys)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class StoreKey(_Named):
    """Every key the two sides use, all under ``PrefixStore(token + "/")``.

    A value with ``{}`` is a family: fill it with :meth:`of` (``StoreKey.PLAN.of(3)``
    is ``plan/3``). The fixed keys are used as they are.
    """

    PLAN = "plan/{}"
    """generation g's plan (supervisor)."""
    HEARTBEAT = "hb/{}"
    """a worker's heartbeat ``{pid, generation, rank, step, t}`` (worker thread)."""
    EVENT = "ev/{}"
    """worker event number n (worker); the supervisor reads, logs and deletes it."""
    EVENT_COUNTER = "ev/count"
    """how many worker events were counted (worker, ``add``)."""
    DONE = "done/{}"
    """rank r finished training (worker)."""
    ERROR = "err/{}"
    """a worker's uncaught program error (``program_error.ProgramError`` JSON), written
    before its process ends; read by the supervisor with the worker's death."""
    PERSIST_REQUEST = "persist/request"
    """a rank got the preemption signal; the supervisor answers with a PERSIST plan."""
    LIVENESS_PORT = "liveness/port"
    """where the supervisor's liveness socket listens now (a restarted one opens a new one)."""
    SHUTDOWN = "shutdown"
    """the job is over: warm standbys exit (supervisor)."""
    RESHARD_HELD = "reshard/{}/held/{}"
    """sharded restore of generation g: the checkpoint shards rank r's node holds (worker)."""
    PG_PREFIX = "gen{}/"
    """prefix of generation g's process-group rendezvous (gloo/NCCL own the keys below it);
    fresh per generation: reusing one breaks gloo's full-mesh connect."""
    GATHER_ROW = "rows/{}/{}"
    """below a generation's ``PG_PREFIX``: rank r's part of its n-th exchange through the
    store in a small world (``reconnect.Generation``: a gather's row, a small state's
    bytes; the store, not a ring of hops or an all-to-all)."""

    def of(self, *parts: object) -> str:
        """The key of a family member; raises ValueError on a fixed key or a wrong arity."""
        n = self.value.count("{}")
        if n == 0 or len(parts) != n:
            raise ValueError(f"store key {self.name} takes {n} part(s), got {len(parts)}")
        return self.value.format(*parts)


class EventKind(_Named):
    """What the supervisor writes to ``events.jsonl`` (its only writer)."""

    JOB_START = "job_start"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"
    PLAN = "plan"
    FAULT_DETECTED = "fault_detected"
    LADDER = "ladder"
    RECOVERY_START = "recovery_start"
    RECOVERY_DONE = "recovery_done"
    PHASE = "phase"
    ISOLATED = "isolated"
    ISOLATE_FAILED = "isolate_failed"
    ISOLATE_HOOK = "isolate_hook"
    STRAGGLER = "straggler"
    NODE_RETURNED = "node_returned"
    FALLBACK = "fallback"
    REQUEUE_START = "requeue_start"
    REQUEUE = "requeue"
    RELAUNCH = "relaunch"
    SUPERVISOR_REATTACHED = "supervisor_reattached"
    SPARE_CHECKED = "spare_checked"
    SPARE_CHECK_FAILED = "spare_check_failed"
    LOCAL_STANDBY_STARTED = "local_standby_started"
    """a warm standby was launched on a worker node (``recovery.local_standbys``)."""
    LOCAL_STANDBY_ADOPTED = "local_standby_adopted"
    """a rank restarted in place went to its node's warm standby (no process start)."""
    EVENT_LOST = "event_lost"
    SUSPECT = "suspect"
    """a rank looks late (a stale heartbeat, a silent pulse) but lives: reported, no recovery."""
    SUSPECT_CLEARED = "suspect_cleared"
    """a suspected or slow rank is well again."""
    PROGRESS_SLOW = "progress_slow"
    """a rank made no progress past the soft step timeout (the hard one recovers it)."""
    MPI_PATH = "mpi_path"
    """``run --mpi`` chose in-place repair (ULFM) or relaunch, and why (``mpi/choose.py``)."""
    ULFM_LAUNCH = "ulfm_launch"
    """the in-place path started ``mpirun --with-ft ulfm`` (attempt, workers, spares)."""
    ULFM_REPAIRED = "ulfm_repaired"
    """the ranks of a ULFM job repaired their communicator in place (lost, promoted, ms)."""
    ULFM_NODE_SILENT = "ulfm_node_silent"
    """a node of a ULFM job went quiet and its slurmd did not answer: ``mpirun`` is ended,
    the node counted lost (``mpi/beat.py``)."""
    ULFM_EXIT = "ulfm_exit"
    """``mpirun`` of the in-place path ended (attempt, exit code)."""


class WorkerEvent(_Named):
    """What a rank reports through the store; logged as ``rank_<value>`` (:attr:`logged`)."""

    RECONNECTED = "reconnected"
    RESTORED = "restored"
    FIRST_STEP = "first_step"
    DONE = "done"
    STOPPED = "stopped"
    FENCED = "fenced"
    PERSISTED = "persisted"
    ABORTED = "aborted"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_DURABLE = "checkpoint_durable"
    CHECKPOINT_REBUILT = "checkpoint_rebuilt"
    CHECKPOINT_REBUILD_FAILED = "checkpoint_rebuild_failed"
    CHECKPOINT_INVALID = "checkpoint_invalid"
    CHECKPOINT_STRIPE_FAILED = "checkpoint_stripe_failed"
    CHECKPOINT_FOREIGN = "checkpoint_foreign"
    """a restore found another run's checkpoints and ignored them (one per restore)."""
    CHECKPOINT_CLEANED = "checkpoint_cleaned"
    """node-local checkpoint directories of ended runs were removed at the job's start."""

    @property
    def logged(self) -> str:
        """The kind under which the supervisor logs it (``rank_restored``)."""
        return "rank_" + self.value


class RecoveryPhase(_Named):
    """The phases of one recovery, in order (``phase`` events, timeline, metrics)::

        detected ─classify─ classified ─replace─ replaced ─ranktable─ published
            ─reconnect─ last rank joined ─restore─ last rank restored ─first_step─ last rank stepped
    """

    CLASSIFY = "classify"
    REPLACE = "replace"
    RANKTABLE = "ranktable"
    RECONNECT = "reconnect"
    RESTORE = "restore"
    FIRST_STEP = "first_step"


class Role(enum.Enum):
    """How a worker process starts: as a rank of a generation, or as a warm standby."""

    RANK = "rank"
    STANDBY = "standby"


_ENV_VARS = {
    "store_addr": "SR_STORE_ADDR",
    "store_port": "SR_STORE_PORT",
    "liveness_port": "SR_LIVENESS_PORT",
    "job_dir": "SR_JOB_DIR",
    "worker_id": "SR_WORKER_ID",
    "node": "SR_NODE",
    "role": "SR_ROLE",
    "generation": "SR_GENERATION",
    "config_path": "SR_CONFIG",
    "job_id": "SR_JOB_ID",
    "run_id": "SR_RUN_ID",
}


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker learns from its launcher, read once from ``SR_*`` variables."""

    store_addr: str
    store_port: int
    liveness_port: int
    token: str
    job_dir: str
    worker_id: str
    node: str
    role: Role
    generation: int
    config_path: str
    job_id: str
    run_id: str
    """the run's id (``run_identity``): which checkpoints are this run's."""

    def to_environ(self) -> dict[str, str]:
        env = {var: str(getattr(self, f)) for f, var in _ENV_VARS.items()}
        env["SR_ROLE"] = self.role.value  # the token travels in a 0600 file, not here
        return env

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "WorkerEnv":
        from .errors import ConfigError

        missing = [v for v in _ENV_VARS.values() if v not in env]
        if missing:
            raise ConfigError(
                "not started by the slurm_resilience supervisor (missing "
                + ", ".join(missing)
                + "): launch with `slurm-resilience submit -- python script.py`"
            )
        job_dir = env["SR_JOB_DIR"]
        return cls(
            store_addr=env["SR_STORE_ADDR"],
            store_port=int(env["SR_STORE_PORT"]),
            liveness_port=int(env["SR_LIVENESS_PORT"]),
            token=read_token(job_dir),
            job_dir=job_dir,
            worker_id=env["SR_WORKER_ID"],
            node=env["SR_NODE"],
            role=Role(env["SR_ROLE"]),
            generation=int(env["SR_GENERATION"]),
            config_path=env["SR_CONFIG"],
            job_id=env["SR_JOB_ID"],
            run_id=env["SR_RUN_ID"],
        )


TOKEN_FILE = "token"


def write_token(job_dir: str, token: str) -> None:
    """Write the per-job secret 0600 (created private, never world-readable)."""
    from .files import write_private

    write_private(os.path.join(job_dir, TOKEN_FILE), token)


def read_token(job_dir: str) -> str:
    """The job's store token from ``JOBDIR/token``."""
    with open(os.path.join(job_dir, TOKEN_FILE)) as f:
        return f.read().strip()


# Preemption of a ``run`` job (``supervisor/executors/relaunch_preempt.py``): every rank
# finds the job directory in this variable, and the supervisor's request to persist
# and exit is this file there (read by ``integrations/snapshots.py``).
RUN_JOB_DIR_VAR = "SR_RUN_JOB_DIR"
PREEMPT_REQUEST_FILE = "preempt.request"


def preempt_request_path(job_dir: str) -> str:
    """Pure: where the supervisor asks the running step to persist and exit."""
    return os.path.join(job_dir, PREEMPT_REQUEST_FILE)
