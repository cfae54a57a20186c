"""What the supervisor knows, as one frozen value; and the policy it decides by.

``decide.py`` is a pure function ``(SupervisorState, observation, now) -> (SupervisorState,
[Action])``. The state is never mutated: every change is a new value made with
``dataclasses.replace``. The same value is what a restarted supervisor reloads
(``to_dict``/``from_dict``, written to ``JOBDIR/supervisor.json`` by ``reattach.py``).

Vocabulary of the counters (the word "restart" is not used for any of them):

- ``fault_retries_used``: process faults of this job answered by restarting processes
  in place (online, or a relaunch in place of every rank); limited by
  ``recovery.fault_retry_times``. Past it, a process fault on a healthy node ends the
  job (or requeues it, within ``recovery.max_requeues``); it takes the node out only
  with node-level evidence (``blame.node_suspect``).
- ``process_failures``: per node, how many of its ranks' processes died (``blame.py``).
- ``requeue_count``: how often Slurm requeued this job before this run
  (``SLURM_RESTART_COUNT``); limited by ``recovery.max_requeues``.
- ``recoveries``: recoveries started in this run (the timeline's numbering).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Mapping

from ...config import ResilienceConfig
from ...lifecycle import JobPhase
from ...model import FaultKind, RankTable
from ...protocol import Role
from .blame import ErrorSeen
from .ladder import FaultCase, Level, LadderPolicy
from .report import Mark


__all__ = ["Mode", "Policy", "WorkerRecord", "Recovery", "SupervisorState", "is_process_fault"]


class Mode(enum.Enum):
    """How ranks are carried: which executor acts on the decisions.

    ONLINE: every rank runs ``Session``; survivors keep their processes and re-form
        (one job step per worker, warm standbys on spares).
    RELAUNCH: an unmodified program (torchrun-style or MPI) runs as one job step for
        all ranks; every recovery relaunches that step (no online level, no scale-in).
    """

    ONLINE = "online"
    RELAUNCH = "relaunch"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """The configuration ``decide`` reads, with what the executor can do."""

    mode: Mode
    ladder: LadderPolicy
    online_timeout_s: float
    fallback_timeout_s: float
    spare_check_max_age_s: float = 300.0
    isolate_state: str
    migrate_stragglers: bool
    local_standbys: bool = False  # warm standbys per node adopt ranks restarted in place (local.py)
    local_standbys_per_node: int | None = 1  # None: "all" (G per node)

    @classmethod
    def from_config(cls, cfg: ResilienceConfig, *, mode: Mode, can_requeue: bool) -> "Policy":
        """The policy ``decide`` follows, from the job's configuration, its mode and whether it may requeue."""
        rc = cfg.recovery
        online = mode is Mode.ONLINE
        return cls(
            mode=mode,
            ladder=LadderPolicy(
                retry_budget=rc.fault_retry_times, min_world_size=rc.min_world_size,
                scale_in=rc.scale_in and online, online=online,
                relaunch=rc.fallback_relaunch or not online,
                # a relaunched program resumes from its own snapshots: no requeue there
                max_requeues=rc.max_requeues if can_requeue and online else 0),
            online_timeout_s=rc.online_timeout_s, fallback_timeout_s=rc.fallback_timeout_s,
            spare_check_max_age_s=rc.spare_check_max_age_s,
            isolate_state=rc.isolate_state, migrate_stragglers=rc.migrate_stragglers and online,
            local_standbys=rc.local_standbys and online,
            local_standbys_per_node=(None if rc.local_standbys_per_node == "all"
                                     else int(rc.local_standbys_per_node)))


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """A worker process the supervisor started: a rank or a warm standby (online mode),
    or the one step that runs every rank (relaunch mode, ``role`` RANK)."""

    worker_id: str
    node: str
    role: Role
    pid: int | None = None
    connected: bool = False
    dead: bool = False
    step: int = 0

    @property
    def step_name(self) -> str:
        """The Slurm step name (``--job-name``) of this worker's step."""
        return f"sr-{self.worker_id}"

    def to_dict(self) -> dict[str, Any]:
        """Its fields for ``supervisor.json`` (written out: ``dataclasses.asdict`` copied
        deeply and cost 0.24 s of the loop per save at 4,096 workers, docs/scale.md)."""
        return {"worker_id": self.worker_id, "node": self.node, "role": self.role.value, "pid": self.pid,
                "connected": self.connected, "dead": self.dead, "step": self.step}


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One recovery in flight. ``cases`` and ``failed`` are the incident: a level that
    times out is added to ``failed`` and the ladder is asked again for the same cases."""

    number: int
    generation: int
    level: Level
    cases: tuple[FaultCase, ...]
    failed: frozenset[Level]
    marks: Mapping[Mark, float]  # detected, classified, replaced, published (unix times)
    deadline: float
    worker_marks: Mapping[Mark, Mapping[int, float]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisorState:
    """Everything the supervisor decides on. Frozen: ``decide`` returns a new one."""

    job_id: str
    phase: JobPhase
    table: RankTable
    target_world: int
    worker_nodes: tuple[str, ...]
    spare_nodes: tuple[str, ...]
    addresses: Mapping[str, str]
    tasks_per_node: int = 1  # G: ranks per node, warm standbys per spare node
    device: str = "cpu"  # "cuda": rank r uses cuda:LOCAL_RANK
    standbys: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # node -> G worker ids
    # node (worker, or spare: its extra ones) -> its own warm standbys (recovery.local_standbys)
    local_standbys: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    excluded: frozenset[str] = frozenset()
    returning: frozenset[str] = frozenset()
    spare_passed: Mapping[str, float] = dataclasses.field(default_factory=dict)  # node -> last passed check
    checking: frozenset[str] = frozenset()  # spare nodes with a health check in flight
    workers: Mapping[str, WorkerRecord] = dataclasses.field(default_factory=dict)
    fault_retries_used: int = 0
    requeue_count: int = 0
    relaunches: int = 0  # relaunch mode: how many times the all-ranks step was started again
    recoveries: int = 0
    next_id: int = 0
    recovery: Recovery | None = None
    errors: tuple[ErrorSeen, ...] = ()  # the programs' own errors the ranks reported (blame.py)
    process_failures: Mapping[str, int] = dataclasses.field(default_factory=dict)  # node -> its ranks' deaths
    failure: Mapping[str, Any] | None = None  # why the job failed, for the status: reason (+ traceback)

    # -- small pure queries ---------------------------------------------------
    @functools.cached_property
    def _slots_by_worker(self) -> dict:
        return {s.worker_id: s for s in self.table.slots}

    def slot_of(self, worker_id: str):
        """The worker's slot in the current table (None: a standby or a retired worker)."""
        return self._slots_by_worker.get(worker_id)

    def watched(self, worker_id: str | None) -> bool:
        """A live rank of the current table, or a standby still in the pool."""
        w = self.workers.get(worker_id) if worker_id else None
        if w is None or w.dead:
            return False
        return (self.slot_of(worker_id) is not None or worker_id in self.standbys.get(w.node, ())
                or worker_id in self.local_standbys.get(w.node, ()))

    def watched_on(self, node: str) -> list[str]:
        """The watched workers of ``node`` (see ``watched``)."""
        return [wid for wid, w in self.workers.items() if w.node == node and self.watched(wid)]

    def watched_nodes(self) -> list[str]:
        """The nodes whose silence matters: the table's and the spares' with standbys, not the excluded."""
        return sorted(n for n in set(self.table.nodes) | set(self.standbys) if n not in self.excluded)

    def free_spares(self, mode: Mode) -> list[str]:
        """Spare nodes usable now: online, those whose G warm standbys are connected (adopting
        them costs no process start) and whose health check passed; relaunch, any spare
        node not in use and not excluded."""
        if mode is Mode.ONLINE:  # passed its health check, and every standby is up
            return [n for n, wids in self.standbys.items() if n not in self.excluded and n in self.spare_passed
                    and all(self.workers[w].connected and not self.workers[w].dead for w in wids if w in self.workers)]
        used = set(self.table.nodes)
        return [n for n in self.spare_nodes if n not in used and n not in self.excluded]

    def new_id(self, node: str) -> tuple["SupervisorState", str]:
        """A fresh worker id on ``node`` (``{node}.{n}``), and the state that has used it."""
        n = self.next_id + 1
        return dataclasses.replace(self, next_id=n), f"{node}.{n}"

    def with_worker(self, rec: WorkerRecord) -> "SupervisorState":
        """This state with ``rec`` added or replaced."""
        return dataclasses.replace(self, workers={**self.workers, rec.worker_id: rec})

    def with_dead(self, *worker_ids: str) -> "SupervisorState":
        """This state with those workers marked dead (unknown ids are ignored)."""
        workers = dict(self.workers)
        for wid in worker_ids:
            if wid in workers:
                workers[wid] = dataclasses.replace(workers[wid], dead=True)
        return dataclasses.replace(self, workers=workers)

    # -- persistence (supervisor.json) -----------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """For ``supervisor.json`` (what a re-attached supervisor reads back with :meth:`from_dict`)."""
        return {
            "job_id": self.job_id, "phase": self.phase.name, "table": self.table.to_dict(),
            "target_world": self.target_world, "worker_nodes": list(self.worker_nodes),
            "spare_nodes": list(self.spare_nodes), "addresses": dict(self.addresses),
            "tasks_per_node": self.tasks_per_node, "device": self.device,
            "standbys": {n: list(w) for n, w in self.standbys.items()}, "excluded": sorted(self.excluded),
            "local_standbys": {n: list(w) for n, w in self.local_standbys.items()},
            "returning": sorted(self.returning), "spare_passed": dict(self.spare_passed),
            "workers": [w.to_dict() for w in self.workers.values()],
            "fault_retries_used": self.fault_retries_used, "requeue_count": self.requeue_count,
            "relaunches": self.relaunches, "recoveries": self.recoveries, "next_id": self.next_id,
            "errors": [e.to_dict() for e in self.errors], "process_failures": dict(self.process_failures),
            "failure": dict(self.failure) if self.failure else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SupervisorState":
        """A re-attached state: a recovery in flight is not carried over (its plan is in
        the store, so the ranks finish it; a rank that never comes up goes stale)."""
        phase = JobPhase[d["phase"]]
        if phase in (JobPhase.RECOVERING, JobPhase.FALLBACK_RELAUNCH, JobPhase.STARTING):
            phase = JobPhase.RUNNING
        workers = {w["worker_id"]: WorkerRecord(
            worker_id=w["worker_id"], node=w["node"], role=Role(w["role"]), pid=w.get("pid"),
            connected=True, dead=bool(w["dead"]), step=int(w.get("step", 0))) for w in d["workers"]}
        return cls(
            job_id=str(d["job_id"]), phase=phase, table=RankTable.from_dict(d["table"]),
            target_world=int(d["target_world"]), worker_nodes=tuple(d["worker_nodes"]),
            spare_nodes=tuple(d["spare_nodes"]), addresses=dict(d["addresses"]),
            tasks_per_node=int(d.get("tasks_per_node", 1)), device=str(d.get("device", "cpu")),
            standbys={n: tuple(w) for n, w in d["standbys"].items()}, excluded=frozenset(d["excluded"]),
            local_standbys={str(n): (str(w),) if isinstance(w, str) else tuple(map(str, w))  # str: one, before
                            for n, w in d.get("local_standbys", {}).items()},
            returning=frozenset(d["returning"]), workers=workers,
            spare_passed={n: float(t) for n, t in d.get("spare_passed", {}).items()},
            fault_retries_used=int(d["fault_retries_used"]), requeue_count=int(d["requeue_count"]),
            relaunches=int(d.get("relaunches", 0)), recoveries=int(d["recoveries"]),
            next_id=int(d["next_id"]), errors=tuple(ErrorSeen.from_dict(e) for e in d.get("errors", ())),
            process_failures={str(n): int(c) for n, c in d.get("process_failures", {}).items()},
            failure=d.get("failure"))


def is_process_fault(kind: FaultKind) -> bool:
    """A fault of a rank's process (died or hung), not of its node."""
    return kind in (FaultKind.PROCESS_DIED, FaultKind.PROCESS_HUNG)
