"""Recovery strategies: where a fault rolls the state back to and how long it stops training.

A strategy maps each fault class to a ``RecoveryPath`` (downtime, rollback point,
whether it takes a spare or a new allocation) and says how often the job
checkpoints. Three ship: the toolkit's online recovery (``toolkit_default``),
job-level requeue and in-job restart from a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Mapping

from slurm_resilience.errors import ConfigError
from slurm_resilience.protocol import RecoveryPhase

from .failures import DAY_S, FaultClass

__all__ = [
    "Rollback", "RecoveryPath", "CheckpointSpec", "Strategy", "PHASE_NAMES", "PhaseTimes",
    "toolkit_default", "requeue_baseline", "in_job_restart",
]


class Rollback(Enum):
    """Where a recovery restores the training state from."""

    STEP = "step"
    """The last step boundary (live state on survivors / peers): at most one step lost."""

    CHECKPOINT = "checkpoint"
    """The last completed checkpoint: the work since it is lost."""


@dataclass(frozen=True, kw_only=True)
class RecoveryPath:
    """How one kind of fault is recovered: downtime, restore point, what it takes."""

    name: str
    """Label used in the breakdown."""
    downtime_s: float
    """Wall time from the fault until training resumes (detect through first step)."""
    rollback: Rollback
    """Restore point."""
    needs_spare: bool = False
    """Takes a spare node from the pool (falls back to ``on_no_spare`` without one)."""
    new_allocation: bool = False
    """The job gets a new allocation (requeue): the spare pool is refilled."""

    def __post_init__(self) -> None:
        if self.downtime_s < 0:
            raise ConfigError(f"recovery path {self.name!r}: downtime_s must be >= 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """How often a strategy checkpoints and what each checkpoint costs."""

    interval_s: float
    """Training time between checkpoints (rounded to whole steps, at least one)."""
    cost_s: float
    """Wall time each checkpoint blocks training (the synchronous part)."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.cost_s < 0:
            raise ConfigError("checkpoint interval_s must be > 0 and cost_s >= 0")


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A recovery strategy: step time, checkpoints, and the path for each kind of fault."""

    name: str
    step_time_s: float
    """Duration of one training step."""
    checkpoint: CheckpointSpec
    on_node: RecoveryPath
    on_process: RecoveryPath
    on_hang: RecoveryPath
    on_no_spare: RecoveryPath
    """Used instead of a path that needs a spare when the pool is empty."""
    spare_nodes: int = 0
    """Spare nodes in the allocation."""
    repair_s: float = DAY_S
    """Time until a failed node is back in the pool as a spare."""
    collective_at: float = 1.0
    """Where in a step (fraction of its time) the ranks meet in the gradient collective.

    A fault earlier in the step leaves the survivors waiting in the collective:
    the partial step is lost. A fault after it cannot stop them: they finish the
    step (productive, overlapping the recovery) and stop at the step's end. 1.0:
    all of a step's compute precedes its collective, so half a step is lost on
    average; ``examples/train_mlp.py`` emulates its compute after the update: 0.0.
    Applies to step-rollback paths only.
    """

    def __post_init__(self) -> None:
        if self.step_time_s <= 0 or self.spare_nodes < 0 or self.repair_s < 0:
            raise ConfigError("step_time_s must be > 0, spare_nodes and repair_s >= 0")
        if not 0.0 <= self.collective_at <= 1.0:
            raise ConfigError(f"collective_at={self.collective_at} must be within [0, 1]")
        if self.on_no_spare.needs_spare:
            raise ConfigError("on_no_spare must not need a spare")

    def path_for(self, fault_class: FaultClass) -> RecoveryPath:
        return {FaultClass.NODE: self.on_node, FaultClass.PROCESS: self.on_process,
                FaultClass.HANG: self.on_hang}[fault_class]

    @property
    def checkpoint_every_s(self) -> float:
        """Checkpoint interval in progress, a whole number of steps."""
        return max(1, round(self.checkpoint.interval_s / self.step_time_s)) * self.step_time_s


# Fault → first completed step: "detect" (fault → detection; no ``phase`` event holds it,
# a measured run takes it from the injection time) then the recovery's own phases.
# They name PhaseTimes' fields, so they are plain strings.
PHASE_NAMES = ("detect", *(p.value for p in RecoveryPhase))


@dataclass(frozen=True, kw_only=True)
class PhaseTimes:
    """The toolkit's online recovery phases in seconds (defaults: README demo, 4 ranks).

    ``first_step`` includes one step of compute; counting it all as downtime is
    conservative by at most one step.
    """

    detect: float = 0.0169
    classify: float = 0.0030
    replace: float = 0.0001
    ranktable: float = 0.0044
    reconnect: float = 0.0585
    restore: float = 0.0111
    first_step: float = 0.0636

    @classmethod
    def from_ms(cls, phases_ms: Mapping[str, float]) -> "PhaseTimes":
        """From a ``{phase: ms}`` mapping; missing phases keep their defaults.

        Raises:
            ConfigError: an unknown phase name or a negative time.
        """
        unknown = sorted(set(phases_ms) - set(PHASE_NAMES))
        if unknown:
            raise ConfigError(f"unknown phase(s) {unknown}; valid: {', '.join(PHASE_NAMES)}")
        if any(float(v) < 0 for v in phases_ms.values()):
            raise ConfigError("phase times must be >= 0")
        return cls(**{k: float(v) / 1000.0 for k, v in phases_ms.items()})

    @property
    def online_s(self) -> float:
        """Fault → first completed step when a warm spare takes over."""
        return sum(getattr(self, n) for n in PHASE_NAMES)


def toolkit_default(
    *,
    phases: PhaseTimes = PhaseTimes(),
    step_time_s: float = 6.0,
    checkpoint: CheckpointSpec = CheckpointSpec(interval_s=1800.0, cost_s=1.0),
    spare_nodes: int = 32,
    repair_s: float = DAY_S,
    process_start_s: float = 3.0,
    heartbeat_timeout_s: float = 2.0,
    requeue_s: float = 600.0,
    queue_wait_s: float = 0.0,
) -> Strategy:
    """Online recovery onto warm spares; restart in place for process faults and hangs.

    A restarted rank pays a cold process start (``process_start_s``) instead of the
    spare choice; a hang is found by the stale heartbeat instead of the socket.
    Both restore from live peers (at most one step lost). Without a spare: requeue.
    """
    on = phases.online_s
    restart = on - phases.replace + process_start_s
    return Strategy(
        name="toolkit default",
        step_time_s=step_time_s,
        checkpoint=checkpoint,
        on_node=RecoveryPath(name="online spare", downtime_s=on, rollback=Rollback.STEP, needs_spare=True),
        on_process=RecoveryPath(name="restart in place", downtime_s=restart, rollback=Rollback.STEP),
        on_hang=RecoveryPath(name="restart in place (hang)", downtime_s=restart - phases.detect + heartbeat_timeout_s,
                             rollback=Rollback.STEP),
        on_no_spare=_requeue(queue_wait_s + requeue_s),
        spare_nodes=spare_nodes,
        repair_s=repair_s,
    )


def requeue_baseline(
    *,
    step_time_s: float = 6.0,
    checkpoint: CheckpointSpec = CheckpointSpec(interval_s=1800.0, cost_s=30.0),
    requeue_s: float = 600.0,
    queue_wait_s: float = 0.0,
    collective_timeout_s: float = 600.0,
) -> Strategy:
    """Every failure ends the job; it is requeued and loads the last checkpoint.

    A hang is only noticed when the collective times out (``collective_timeout_s``).
    """
    rq = _requeue(queue_wait_s + requeue_s)
    return Strategy(
        name="job-level requeue", step_time_s=step_time_s, checkpoint=checkpoint,
        on_node=rq, on_process=rq, on_hang=replace(rq, downtime_s=rq.downtime_s + collective_timeout_s),
        on_no_spare=rq,
    )


def in_job_restart(
    *,
    step_time_s: float = 6.0,
    checkpoint: CheckpointSpec = CheckpointSpec(interval_s=1800.0, cost_s=30.0),
    restart_s: float = 300.0,
    requeue_s: float = 600.0,
    queue_wait_s: float = 0.0,
    collective_timeout_s: float = 600.0,
) -> Strategy:
    """Process faults and hangs: every rank restarts inside the allocation from the
    last checkpoint (``restart_s``: launch, communicator init, load). Without spares a
    node fault cannot be absorbed in the job: requeue.
    """
    ij = RecoveryPath(name="in-job restart", downtime_s=restart_s, rollback=Rollback.CHECKPOINT)
    rq = _requeue(queue_wait_s + requeue_s)
    return Strategy(
        name="in-job restart (no spares)", step_time_s=step_time_s, checkpoint=checkpoint,
        on_node=rq, on_process=ij, on_hang=replace(ij, downtime_s=restart_s + collective_timeout_s),
        on_no_spare=rq,
    )


def _requeue(downtime_s: float) -> RecoveryPath:
    return RecoveryPath(name="requeue", downtime_s=downtime_s, rollback=Rollback.CHECKPOINT, new_allocation=True)
