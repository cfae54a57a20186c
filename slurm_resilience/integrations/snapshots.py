"""What the framework integrations share: per-step node-local snapshots, the restore
plan, the resume position and the preemption check (``lightning.py``, ``accelerate.py``).

A snapshot is one file per step and node, ``step-000000012.pt``, written atomically by
one rank per node: under DDP every rank holds the whole state, so any surviving node's
copy restores everyone (a spare's ranks get it over the process group). Under
``slurm-resilience run`` the job directory also holds the **durable** copy that a
preemption writes (``JOBDIR/KIND/JOB``, supervisor/executors/relaunch_preempt.py): a requeued job
may land on nodes that hold nothing.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import socket
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..protocol import RUN_JOB_DIR_VAR, preempt_request_path


__all__ = [
    "SNAPSHOT_PREFIX", "SnapshotEnv", "check_counts", "RestorePlan", "plan_restore", "resume_position", "NodeSnapshots",
    "gather_newest", "fetch_snapshot", "Persisted", "preempt_requested"
]


SNAPSHOT_PREFIX = "step-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotEnv:
    """What an integration reads from the environment, once (``from_env``)."""

    KIND: ClassVar[str] = "snapshots"
    """The integration's folder name (``lightning``, ``accelerate``); its root variable is
    ``SR_<KIND>_DIR``."""

    job_id: str | None
    """``SLURM_JOB_ID``: keys the default snapshot directory; without it (and without
    ``directory``) no snapshots are kept: an old run's could be taken for this one's."""
    node: str
    """``SLURMD_NODENAME``, else the host name: the node-local directory's name."""
    progress_file: str | None
    """``SR_PROGRESS_FILE``: set by ``slurm-resilience run`` for each relaunch."""
    root: str | None
    """``SR_LIGHTNING_DIR`` / ``SR_ACCELERATE_DIR``: the snapshot root instead of the
    default (one folder per node under it); lets a run without Slurm keep snapshots."""
    user: str
    run_job_dir: str | None = None
    """``SR_RUN_JOB_DIR``: the job directory of a ``slurm-resilience run`` job: its
    preemption request and the durable copy (``JOBDIR/KIND/JOB``) live there."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SnapshotEnv":
        return cls(job_id=env.get("SLURM_JOB_ID") or None,
                   node=env.get("SLURMD_NODENAME") or socket.gethostname(),
                   progress_file=env.get("SR_PROGRESS_FILE") or None,
                   root=env.get(f"SR_{cls.KIND.upper()}_DIR") or None,
                   user=getpass.getuser(), run_job_dir=env.get(RUN_JOB_DIR_VAR) or None)

    def default_dir(self) -> Path | None:
        if self.root is not None:
            return Path(self.root) / self.node
        if self.job_id is None:
            return None
        return Path(f"/tmp/slurm_resilience-{self.user}/{self.KIND}/{self.job_id}/{self.node}")

    def durable_dir(self) -> Path | None:
        """``JOBDIR/KIND/JOB`` under ``run`` (keyed by the job id too: a job directory used
        again by another job never restores this one's), else None."""
        if self.run_job_dir is None:
            return None
        return Path(self.run_job_dir) / self.KIND / (self.job_id or "local")


def check_counts(owner: str, **values: Any) -> None:
    """Raises ``ConfigError`` (one line) for a value that is not an integer >= 1."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}({name}={value!r}): must be an integer >= 1")


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Where the state comes from: ``step`` -1 means a fresh start (no ``source``);
    ``durable``: rank 0 reads the job directory's copy (``source`` is 0)."""

    step: int
    source: int | None
    durable: bool = False


def plan_restore(newest: Sequence[int], durable: int = -1) -> RestorePlan:
    """Pure: the newest step any rank's node holds (-1: none) and the lowest rank holding
    it; the job directory's copy (``durable``) only when it is newer than every node's
    (a node's disk is the faster read)."""
    if not newest:
        raise ValueError("plan_restore needs one entry per rank")
    step = max(newest)
    if durable > step:
        return RestorePlan(durable, 0, durable=True)
    return RestorePlan(step, None if step < 0 else list(newest).index(step))


def resume_position(epoch: int, processed: int, num_batches: float) -> tuple[int, int]:
    """Pure: (sampler epoch, batches to skip) after a restore from a step's end.

    ``epoch``/``processed``: the epoch and its completed batches in the snapshot. A
    snapshot of an epoch's last batch resumes at the next epoch's start.
    """
    if processed >= num_batches:
        return epoch + 1, 0
    return epoch, processed


class NodeSnapshots:
    """Snapshots of one node in a directory: ``step-000000012.pt``, written atomically."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def _path(self, step: int) -> Path:
        return self.directory / f"{SNAPSHOT_PREFIX}{step:09d}.pt"

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            stem = p.name[len(SNAPSHOT_PREFIX):-3]
            if p.name.startswith(SNAPSHOT_PREFIX) and p.name.endswith(".pt") and stem.isdigit():
                found.append(int(stem))
        return sorted(found)

    def newest(self) -> int:
        found = self.steps()
        return found[-1] if found else -1

    def write(self, step: int, state: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self._path(step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, final)
        for old in self.steps()[:-self.keep]:
            self._path(old).unlink(missing_ok=True)

    def read_bytes(self, step: int) -> bytes:
        return self._path(step).read_bytes()


def gather_newest(snapshots: NodeSnapshots | None, durable: NodeSnapshots | None, *, rank: int,
                  world_size: int) -> tuple[RestorePlan, list[int], int]:
    """Collective: every rank says the newest step its node holds, rank 0 the durable one;
    returns the plan, the nodes' steps by rank and the durable step. A rank missing hangs."""
    newest = snapshots.newest() if snapshots is not None else -1
    kept = durable.newest() if durable is not None and rank == 0 else -1
    gathered: list[Any] = [(newest, kept)]
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (newest, kept))
    steps, kept = [int(s) for s, _ in gathered], int(gathered[0][1])
    return plan_restore(steps, durable=kept), steps, kept


def fetch_snapshot(plan: RestorePlan, snapshots: NodeSnapshots | None, durable: NodeSnapshots | None, *,
                   rank: int, world_size: int) -> bytes:
    """Collective: the planned snapshot's bytes on every rank, read by ``plan.source`` (from
    its node, or rank 0 from the job directory) and broadcast over the process group."""
    store = durable if plan.durable else snapshots
    blob = [store.read_bytes(plan.step) if rank == plan.source and store is not None else None]
    if world_size > 1:
        dist.broadcast_object_list(blob, src=plan.source)
    return blob[0]


class Persisted(SystemExit):
    """Raised on every rank after a preemption request was carried out: the step just
    completed is in the job directory, the process ends (status 0) and the code after
    the training loop does not run; the requeued job resumes from that step."""


def preempt_requested(run_job_dir: str | None, *, rank: int, world_size: int, device: Any = "cpu") -> bool:
    """Collective under ``run`` (``run_job_dir`` set): rank 0's answer (does the supervisor's
    request exist?) on every rank, so that all stop after the same step. One stat and one
    1-element broadcast per step; without ``run`` False at once, no collective."""
    if run_job_dir is None:
        return False
    asked = rank == 0 and os.path.exists(preempt_request_path(run_job_dir))
    if world_size > 1:
        flag = torch.tensor([int(asked)], device=device)
        dist.broadcast(flag, src=0)
        asked = bool(flag.item())
    return asked
