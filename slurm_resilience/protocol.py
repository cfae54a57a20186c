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
                "table": self.table.to_dict(),
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
            table=RankTable.from_dict(d["table"]),
            joining=tuple(int(r) for r in d["joining"]),
            reason=str(d.get("reason", "")),
        )


# Store keys (all under PrefixStore(token + "/")).
def plan_key(generation: int) -> str:
    return f"plan/{generation}"


def heartbeat_key(worker_id: str) -> str:
    return f"hb/{worker_id}"


def pg_prefix(generation: int) -> str:
    """Fresh prefix per generation: reusing one breaks gloo's full-mesh connect."""
    return f"gen{generation}/"


# Set by a rank that received the preemption signal (sent to the job steps, as
# submitit does). Only a request: the supervisor answers with a PERSIST plan, so
# every rank stops at the same step (a rank acting on the key by itself could
# abandon a step whose collective completed on the others).
PERSIST_REQUEST_KEY = "persist/request"


EVENT_COUNTER = "ev/count"
# Where the supervisor's liveness socket listens now: a restarted supervisor opens a
# new one and the workers reconnect to it (their first port comes in SR_LIVENESS_PORT).
LIVENESS_PORT_KEY = "liveness/port"
SHUTDOWN_KEY = "shutdown"


def event_key(n: int) -> str:
    return f"ev/{n}"


def done_key(rank: int) -> str:
    return f"done/{rank}"


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
        )


TOKEN_FILE = "token"


def write_token(job_dir: str, token: str) -> None:
    """Write the per-job secret 0600 (created private, never world-readable)."""
    from .files import write_private

    write_private(os.path.join(job_dir, TOKEN_FILE), token)


def read_token(job_dir: str) -> str:
    with open(os.path.join(job_dir, TOKEN_FILE)) as f:
        return f.read().strip()
