"""The discrete-event engine: one job's wall time under failures, booked by phase.

Every second of wall time is exactly one of productive, lost work (trained, then
rolled back), recovery or checkpoint; see ``goodput`` for the model.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Sequence

import numpy as np

from slurm_resilience.errors import ConfigError

from .failures import Cluster, FailureModel
from .strategies import RecoveryPath, Rollback, Strategy

__all__ = ["SimResult", "simulate", "summarize"]


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
            into = progress - restore
            if (chosen.rollback is Rollback.STEP and phase is _Phase.TRAINING and into > 1e-9 * step
                    and into >= strategy.collective_at * step):
                # Past the collective: the survivors finish the step while the
                # recovery starts; that time is training, not downtime.
                extra = min(step - into, chosen.downtime_s)
                progress += extra
                down -= extra
                restore = progress
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
