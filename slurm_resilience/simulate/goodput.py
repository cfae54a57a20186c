"""Discrete-event goodput simulator: the ETTR of a recovery strategy under failures.

The model
---------
The job trains at constant speed. Its *progress* P is the training time embodied in
the state it holds. Steps lie on a grid of ``step_time_s`` in progress; checkpoints
on a grid of ``interval_s`` rounded to whole steps, each blocking training for
``cost_s``. Failures arrive as independent Poisson processes, one per category. A
failure picks a recovery path from the strategy by the category's fault class; the
path rolls P back (to the last step boundary, or to the last completed checkpoint)
and stops training for ``downtime_s``::

    progress ─train─┐ckpt┌─train──────X          (X: fault; lost = P - restore point)
                                     └─recovery─┐ (downtime_s)
                                                └─train from the restore point ─…

A fault during a recovery restarts recovery from its own time with the slower of
the two paths (conservative: the job is rebuilt again). A node fault on a path that
needs a spare takes one from the pool and the failed node returns as a spare after
``repair_s``; with none left the strategy's ``on_no_spare`` path runs. A path with
``new_allocation`` (a requeue) refills the pool and forgets pending repairs. Every
second of wall time is exactly one of: productive, lost work (trained, then rolled
back), recovery, checkpoint.

Default failure rates: Meta, "The Llama 3 Herd of Models" (2024), Table 5 — 419
unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs. The
per-category shares below are recalled, not copied: they sum to 94.5%, so they
are normalised to 419 in all. Check them against the paper before quoting.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum
from typing import Mapping, Sequence

import numpy as np

from slurm_resilience.errors import ConfigError

__all__ = [
    "FaultClass", "FailureCategory", "LLAMA3_CATEGORIES", "FailureModel", "Cluster",
    "Rollback", "RecoveryPath", "CheckpointSpec", "Strategy", "PhaseTimes",
    "toolkit_default", "requeue_baseline", "in_job_restart", "SimResult",
    "simulate", "summarize", "expected_ettr", "validate_against_run", "DAY_S",
]

DAY_S = 86_400.0


class FaultClass(Enum):
    """What a failure takes down, which decides the recovery path."""

    NODE = "node"
    """The node must leave the job (hardware, host maintenance): needs a spare."""

    PROCESS = "process"
    """A rank's process dies on a healthy node: restart in place."""

    HANG = "hang"
    """A rank stops making progress (e.g. an NCCL watchdog timeout): found by timeout."""


@dataclass(frozen=True, kw_only=True)
class FailureCategory:
    name: str
    """Root-cause category as named in the source."""
    share: float
    """Fraction of all unexpected interruptions (normalised over the model)."""
    fault_class: FaultClass
    """Node, process or hang fault."""


_N, _P, _H = FaultClass.NODE, FaultClass.PROCESS, FaultClass.HANG
# Llama 3 paper, Table 5 (as recalled; check before quoting).
LLAMA3_CATEGORIES: tuple[FailureCategory, ...] = tuple(
    FailureCategory(name=n, share=s / 100.0, fault_class=c)
    for n, s, c in (
        ("faulty GPU", 30.1, _N),
        ("GPU HBM3 memory", 17.2, _N),
        ("software bug", 12.9, _P),
        ("network switch/cable", 8.4, _N),
        ("host maintenance", 7.6, _N),
        ("GPU SRAM memory", 4.5, _N),
        ("GPU system processor", 4.1, _N),
        ("NIC", 1.7, _N),
        ("NCCL watchdog timeouts", 1.7, _H),
        ("silent data corruption", 1.4, _N),
        ("GPU thermal interface + sensor", 1.0, _N),
        ("SSD", 0.7, _N),
        ("power supply", 0.7, _N),
        ("server chassis", 0.5, _N),
        ("IO expansion board", 0.5, _N),
        ("dependency", 0.5, _P),
        ("CPU", 0.5, _N),
        ("system memory", 0.5, _N),
    )
)


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    categories: tuple[FailureCategory, ...] = LLAMA3_CATEGORIES
    """Categories and their shares; shares are normalised to sum to 1."""
    interruptions: float = 419.0
    """Unexpected interruptions observed in the reference run."""
    period_s: float = 54 * DAY_S
    """Length of the reference run."""
    reference_gpus: int = 16_384
    """GPUs of the reference run; rates scale linearly with GPU count."""
    rate_scale: float = 1.0
    """Multiplier on every rate (sensitivity studies)."""

    def __post_init__(self) -> None:
        if not self.categories:
            raise ConfigError("a failure model needs at least one category")
        if any(c.share < 0 for c in self.categories) or sum(c.share for c in self.categories) <= 0:
            raise ConfigError("category shares must be >= 0 and not all zero")
        if self.interruptions < 0 or self.period_s <= 0 or self.reference_gpus <= 0 or self.rate_scale < 0:
            raise ConfigError("interruptions and rate_scale must be >= 0; period_s and reference_gpus > 0")

    def rates_per_s(self, gpus: int) -> np.ndarray:
        """Failure rate of each category (per second) for a job on ``gpus`` GPUs."""
        shares = np.array([c.share for c in self.categories], dtype=float)
        per_gpu = self.interruptions / (self.period_s * self.reference_gpus)
        return shares / shares.sum() * per_gpu * gpus * self.rate_scale

    def expected_failures(self, gpus: int, horizon_s: float) -> float:
        """Mean number of failures in ``horizon_s`` on ``gpus`` GPUs."""
        return float(self.rates_per_s(gpus).sum() * horizon_s)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    gpus: int = 16_384
    """GPUs that train (failure rates scale with this)."""
    gpus_per_node: int = 8
    """GPUs per node; a node fault costs the job one node."""

    def __post_init__(self) -> None:
        if self.gpus <= 0 or self.gpus_per_node <= 0 or self.gpus % self.gpus_per_node:
            raise ConfigError(f"gpus ({self.gpus}) must be a positive multiple of gpus_per_node ({self.gpus_per_node})")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


class Rollback(Enum):
    """Where a recovery restores the training state from."""

    STEP = "step"
    """The last step boundary (live state on survivors / peers): at most one step lost."""

    CHECKPOINT = "checkpoint"
    """The last completed checkpoint: the work since it is lost."""


@dataclass(frozen=True, kw_only=True)
class RecoveryPath:
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
    interval_s: float
    """Training time between checkpoints (rounded to whole steps, at least one)."""
    cost_s: float
    """Wall time each checkpoint blocks training (the synchronous part)."""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.cost_s < 0:
            raise ConfigError("checkpoint interval_s must be > 0 and cost_s >= 0")


@dataclass(frozen=True, kw_only=True)
class Strategy:
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

    def __post_init__(self) -> None:
        if self.step_time_s <= 0 or self.spare_nodes < 0 or self.repair_s < 0:
            raise ConfigError("step_time_s must be > 0, spare_nodes and repair_s >= 0")
        if self.on_no_spare.needs_spare:
            raise ConfigError("on_no_spare must not need a spare")

    def path_for(self, fault_class: FaultClass) -> RecoveryPath:
        return {FaultClass.NODE: self.on_node, FaultClass.PROCESS: self.on_process,
                FaultClass.HANG: self.on_hang}[fault_class]

    @property
    def checkpoint_every_s(self) -> float:
        """Checkpoint interval in progress, a whole number of steps."""
        return max(1, round(self.checkpoint.interval_s / self.step_time_s)) * self.step_time_s


PHASE_NAMES = ("detect", "classify", "replace", "ranktable", "reconnect", "restore", "first_step")


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


@dataclass(frozen=True)
class SimResult:
    """One simulated run. ``wall_s`` = productive + lost work + recovery + checkpoint."""

    strategy: str
    wall_s: float
    productive_s: float
    lost_work_s: float
    recovery_s: float
    checkpoint_s: float
    failures: int
    failures_by_class: dict[str, int] = field(default_factory=dict)
    recoveries_by_path: dict[str, int] = field(default_factory=dict)

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s

    def fractions(self) -> dict[str, float]:
        """Each share of wall time; they sum to 1."""
        w = self.wall_s
        return {"ettr": self.productive_s / w, "lost_work": self.lost_work_s / w,
                "recovery": self.recovery_s / w, "checkpoint": self.checkpoint_s / w}


class _Ev(IntEnum):
    # Value order breaks ties at equal times: a fault at the instant a checkpoint
    # or recovery would finish interrupts it.
    FAILURE = 0
    REPAIRED = 1
    CHECKPOINT_DUE = 2
    CHECKPOINT_DONE = 3
    RECOVERED = 4


class _Phase(Enum):
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    RECOVERING = "recovering"


def simulate(
    cluster: Cluster,
    model: FailureModel,
    strategy: Strategy,
    horizon_s: float,
    *,
    seed: int = 0,
    injected: Sequence[tuple[float, str]] | None = None,
) -> SimResult:
    """Run the job for ``horizon_s`` of wall time.

    Failures are drawn per category from ``numpy.random.default_rng(seed)``, or,
    with ``injected``, are exactly the given ``(time_s, category name)`` pairs.

    Raises:
        ConfigError: ``horizon_s`` <= 0 or an injected category is unknown.
    """
    if horizon_s <= 0:
        raise ConfigError("horizon_s must be > 0")
    by_name = {c.name: i for i, c in enumerate(model.categories)}
    rng = np.random.default_rng(seed)
    rates = model.rates_per_s(cluster.gpus)
    heap: list[tuple[float, int, int, int]] = []  # (time, event, seq, payload)
    seq = 0

    def push(t: float, ev: _Ev, payload: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, int(ev), seq, payload))

    def next_arrival(t: float, cat: int) -> None:
        if rates[cat] > 0:
            push(t + rng.exponential(1.0 / rates[cat]), _Ev.FAILURE, cat)

    if injected is None:
        for cat in range(len(model.categories)):
            next_arrival(0.0, cat)
    else:
        for t, name in injected:
            if name not in by_name:
                raise ConfigError(f"unknown failure category {name!r}; valid: {', '.join(by_name)}")
            push(float(t), _Ev.FAILURE, by_name[name])

    step, every, ckpt_cost = strategy.step_time_s, strategy.checkpoint_every_s, strategy.checkpoint.cost_s
    phase, t_mark, progress, last_ckpt = _Phase.TRAINING, 0.0, 0.0, 0.0
    epoch = alloc = 0  # epoch invalidates scheduled phase ends; alloc, pending repairs
    spares = strategy.spare_nodes
    path: RecoveryPath | None = None
    lost = down = ckpt = 0.0
    n_fail = 0
    by_class: dict[str, int] = {}
    by_path: dict[str, int] = {}

    def settle(t: float) -> None:
        """Book the time since ``t_mark`` to the current phase."""
        nonlocal progress, down, ckpt, t_mark
        if phase is _Phase.TRAINING:
            progress += t - t_mark
        elif phase is _Phase.CHECKPOINTING:
            ckpt += t - t_mark
        else:
            down += t - t_mark
        t_mark = t

    def train_from(t: float) -> None:
        nonlocal phase, epoch
        phase, epoch = _Phase.TRAINING, epoch + 1
        push(t + max(0.0, last_ckpt + every - progress), _Ev.CHECKPOINT_DUE, epoch)

    train_from(0.0)
    while heap and heap[0][0] < horizon_s:
        t, ev, _, payload = heapq.heappop(heap)
        if ev == _Ev.FAILURE:
            if injected is None:
                next_arrival(t, payload)
            settle(t)
            cls = model.categories[payload].fault_class
            n_fail += 1
            by_class[cls.value] = by_class.get(cls.value, 0) + 1
            chosen = strategy.path_for(cls)
            if chosen.needs_spare:
                if spares > 0:
                    spares -= 1
                    push(t + strategy.repair_s, _Ev.REPAIRED, alloc)
                else:
                    chosen = strategy.on_no_spare
            if phase is _Phase.RECOVERING and path is not None and path.downtime_s > chosen.downtime_s:
                chosen = path  # the slower rebuild in progress starts again
            restore = last_ckpt if chosen.rollback is Rollback.CHECKPOINT else _floor_to(progress, step)
            lost += progress - restore
            progress = restore
            if chosen.new_allocation:
                alloc, spares = alloc + 1, strategy.spare_nodes
            by_path[chosen.name] = by_path.get(chosen.name, 0) + 1
            path, phase, epoch = chosen, _Phase.RECOVERING, epoch + 1
            push(t + chosen.downtime_s, _Ev.RECOVERED, epoch)
        elif ev == _Ev.REPAIRED:
            if payload == alloc:
                spares += 1
        elif payload != epoch:
            continue  # a checkpoint or recovery that a fault interrupted
        elif ev == _Ev.CHECKPOINT_DUE:
            settle(t)
            phase, epoch = _Phase.CHECKPOINTING, epoch + 1
            push(t + ckpt_cost, _Ev.CHECKPOINT_DONE, epoch)
        elif ev == _Ev.CHECKPOINT_DONE:
            settle(t)
            last_ckpt = progress
            train_from(t)
        elif ev == _Ev.RECOVERED:
            settle(t)
            path = None
            train_from(t)
    settle(horizon_s)
    return SimResult(strategy=strategy.name, wall_s=horizon_s, productive_s=progress, lost_work_s=lost,
                     recovery_s=down, checkpoint_s=ckpt, failures=n_fail,
                     failures_by_class=by_class, recoveries_by_path=by_path)


def _floor_to(x: float, grid: float) -> float:
    # The epsilon keeps a state that sits on a boundary (up to rounding) on it.
    return math.floor(x / grid + 1e-9) * grid


def summarize(results: Sequence[SimResult]) -> dict[str, float]:
    """Mean and (sample) standard deviation of ETTR and its breakdown over runs."""
    out: dict[str, float] = {}
    for key in ("ettr", "lost_work", "recovery", "checkpoint"):
        vals = np.array([r.fractions()[key] for r in results])
        out[f"{key}_mean"] = float(vals.mean())
        out[f"{key}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
    fails = np.array([r.failures for r in results], dtype=float)
    out["failures_mean"] = float(fails.mean())
    out["failures_std"] = float(fails.std(ddof=1)) if len(fails) > 1 else 0.0
    return out


def expected_ettr(*, wall_s: float, faults: float, downtime_s: float, step_time_s: float,
                  checkpoint_interval_s: float, checkpoint_cost_s: float = 0.0) -> float:
    """Closed form for step-rollback recoveries: each fault costs its downtime plus
    half a step of lost work on average; checkpoints take ``cost/(interval+cost)`` of
    the rest.
    """
    every = max(1, round(checkpoint_interval_s / step_time_s)) * step_time_s
    running = max(0.0, wall_s - faults * (downtime_s + step_time_s / 2.0))
    return running * every / (every + checkpoint_cost_s) / wall_s


_OBSERVED_REQUIRED = ("wall_time_s", "faults", "phases_ms", "step_time_s", "checkpoint_interval_s")
_OBSERVED_OPTIONAL = ("checkpoint_cost_s", "fault_class", "productive_time_s", "steps", "ettr")


def validate_against_run(observed: Mapping[str, object]) -> dict[str, object]:
    """Predict a measured run's ETTR from its phase times and compare.

    ``observed`` holds ``wall_time_s``, ``faults`` (injected), ``phases_ms``
    (``{phase: ms}``, see ``PHASE_NAMES``), ``step_time_s`` and
    ``checkpoint_interval_s``; optionally ``checkpoint_cost_s`` (default 0),
    ``fault_class`` (``node``/``process``/``hang``, default ``node``) and the observed
    outcome as ``ettr``, ``productive_time_s`` or ``steps`` (completed).

    Raises:
        ConfigError: a key is missing or unknown, or a value is out of range.
    """
    missing = [k for k in _OBSERVED_REQUIRED if k not in observed]
    unknown = sorted(set(observed) - set(_OBSERVED_REQUIRED) - set(_OBSERVED_OPTIONAL))
    if missing or unknown:
        raise ConfigError(f"observed run: missing {missing}, unknown {unknown}; "
                          f"valid: {', '.join(_OBSERVED_REQUIRED + _OBSERVED_OPTIONAL)}")
    wall, step = float(observed["wall_time_s"]), float(observed["step_time_s"])
    faults = int(observed["faults"])  # type: ignore[arg-type]
    if wall <= 0 or step <= 0 or faults < 0:
        raise ConfigError("wall_time_s and step_time_s must be > 0, faults >= 0")
    phases = PhaseTimes.from_ms(observed["phases_ms"])  # type: ignore[arg-type]
    try:
        cls = FaultClass(observed.get("fault_class", "node"))
    except ValueError:
        raise ConfigError(f"fault_class must be one of {[c.value for c in FaultClass]}") from None
    strategy = toolkit_default(phases=phases, step_time_s=step, spare_nodes=max(faults, 1),
                               checkpoint=CheckpointSpec(interval_s=float(observed["checkpoint_interval_s"]),  # type: ignore[arg-type]
                                                         cost_s=float(observed.get("checkpoint_cost_s", 0.0))))  # type: ignore[arg-type]
    downtime = strategy.path_for(cls).downtime_s
    predicted = expected_ettr(wall_s=wall, faults=faults, downtime_s=downtime, step_time_s=step,
                              checkpoint_interval_s=strategy.checkpoint.interval_s,
                              checkpoint_cost_s=strategy.checkpoint.cost_s)
    if "ettr" in observed:
        seen: float | None = float(observed["ettr"])  # type: ignore[arg-type]
    elif "productive_time_s" in observed:
        seen = float(observed["productive_time_s"]) / wall  # type: ignore[arg-type]
    elif "steps" in observed:
        seen = float(observed["steps"]) * step / wall  # type: ignore[arg-type]
    else:
        seen = None
    return {
        "predicted_ettr": predicted,
        "observed_ettr": seen,
        "difference": None if seen is None else seen - predicted,
        "downtime_per_fault_s": downtime,
        "expected_lost_work_per_fault_s": step / 2.0,
        "fault_class": cls.value,
        "faults": faults,
    }
