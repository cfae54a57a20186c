"""A measured run, read purely: the fault schedule, the training window, ETTR, phases.

What the model is validated against is a real job with faults injected by a
Poisson process. These functions turn that job's event log (``events.jsonl``,
dicts as ``slurm_resilience.events.read_events`` returns them) into the model's
inputs and the observed outcome; nothing here reads files or clocks.

The training window (all times are the event log's unix times)::

    launch ── import, store, gloo ──┐ start: the last rank restored in generation 0
                                    ├─ steps ─ X ─ recovery ─ steps ─ … ─┐
                                    end: the last rank reported done ────┘

Process launch and the final barrier are outside it: they cost the same with
and without faults and the model has no term for them.

Observed ETTR = ``steps * step_time_s / (end - start)``: the steps that reached
the final state, each costed at the fault-free step time, over the window's wall
time: the share of the window that would have been enough without faults.

The fault-free step time is best taken from the run itself
(``productive_step_time``): on a shared box the load drifts between runs, and a
few percent of step time is a few points of ETTR. It is the mean step time of
the run's stretches of training: from a generation's restore (every rank holds
the state) to the next fault, or to the end::

    restored(g) ── s(g') - s(g) steps ── X fault        restored(g') ── …
    |<───────────── measured ──────────>|(1/2 - collective_at) step unseen

A fault before the step's collective (``collective_at`` = 1) leaves the partial
step it interrupts (half a step on average) inside the stretch but uncounted; a
fault after it (0) lets the survivors count a step whose last half comes after
the fault. Faults during a recovery start no stretch. A stretch much slower than
the others had a stall inside (``productive_step_time`` leaves it out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from slurm_resilience.errors import ConfigError, IncompleteRunError
from slurm_resilience.protocol import EventKind, RecoveryPhase, WorkerEvent

from .strategies import PHASE_NAMES

__all__ = [
    "IncompleteRunError", "poisson_schedule", "TrainingWindow", "training_window",
    "observed_ettr", "Stretch", "training_stretches", "StepTime", "productive_step_time",
    "recovery_phases_ms", "mean_phases_ms",
]

_RESTORED = WorkerEvent.RESTORED.logged


def poisson_schedule(*, mean_interval_s: float, horizon_s: float, seed: int) -> tuple[float, ...]:
    """Arrival times in ``[0, horizon_s)`` of a Poisson process with the given mean
    time between arrivals (exponential gaps from ``numpy.random.default_rng(seed)``).

    Raises:
        ConfigError: ``mean_interval_s`` or ``horizon_s`` is not > 0.
    """
    if mean_interval_s <= 0 or horizon_s <= 0:
        raise ConfigError("mean_interval_s and horizon_s must be > 0")
    rng = np.random.default_rng(seed)
    out: list[float] = []
    t = float(rng.exponential(mean_interval_s))
    while t < horizon_s:
        out.append(t)
        t += float(rng.exponential(mean_interval_s))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class TrainingWindow:
    """From every rank holding its state to the last rank done, in a measured run."""

    start: float
    """The last rank's ``restored`` event of generation 0: every rank holds the state."""
    end: float
    """The last rank's ``done`` event."""
    steps: int
    """Steps in the final state."""

    @property
    def wall_s(self) -> float:
        return self.end - self.start


def training_window(events: Sequence[Mapping[str, Any]]) -> TrainingWindow:
    """The training window of a finished run (see the module docstring).

    Raises:
        IncompleteRunError: no generation-0 restore or no rank finished.
    """
    starts = [e["t"] for e in events if e["kind"] == _RESTORED and e.get("generation") == 0]
    dones = [e for e in events if e["kind"] == WorkerEvent.DONE.logged]
    if not starts or not dones:
        raise IncompleteRunError(f"the run has {len(starts)} generation-0 restores and {len(dones)} "
                                 "done events: did it finish?")
    return TrainingWindow(start=max(starts), end=max(e["t"] for e in dones),
                          steps=max(int(e["step"]) for e in dones))


def observed_ettr(*, steps: int, step_time_s: float, wall_s: float) -> float:
    """Productive time (``steps`` at the fault-free ``step_time_s``) over wall time.

    Raises:
        ConfigError: ``step_time_s`` or ``wall_s`` is not > 0, or ``steps`` < 0.
    """
    if step_time_s <= 0 or wall_s <= 0 or steps < 0:
        raise ConfigError("step_time_s and wall_s must be > 0 and steps >= 0")
    return steps * step_time_s / wall_s


@dataclass(frozen=True)
class Stretch:
    """Training between a generation's restore and the next fault (or re-forming, or the end)."""

    seconds: float
    steps: float
    """Steps credited to it; a stretch a fault ended is corrected by ``1/2 - collective_at``."""


def training_stretches(events: Sequence[Mapping[str, Any]], fault_times: Iterable[float] = (),
                       *, collective_at: float = 1.0) -> list[Stretch]:
    """A finished run's stretches of training, in order (module docstring).

    Raises:
        IncompleteRunError: the run did not finish, or no generation followed a fault.
        ConfigError: ``collective_at`` outside [0, 1].
    """
    if not 0.0 <= collective_at <= 1.0:
        raise ConfigError(f"collective_at={collective_at} must be within [0, 1]")
    window = training_window(events)
    world = len({e["rank"] for e in events if e["kind"] == _RESTORED and e.get("generation") == 0})
    restores: dict[int, list[Mapping[str, Any]]] = {}
    for e in events:
        if e["kind"] == _RESTORED:
            restores.setdefault(int(e["generation"]), []).append(e)
    # (time, step) of every generation all ranks restored into, in time order
    starts = sorted((max(r["t"] for r in rs), int(rs[0]["step"]))
                    for rs in restores.values() if len({r["rank"] for r in rs}) == world)
    faults = sorted(f for f in fault_times if window.start <= f < window.end)
    out = []
    for i, (t, step) in enumerate(starts):
        fault = next((f for f in faults if f >= t), None)
        nxt = starts[i + 1] if i + 1 < len(starts) else None
        if nxt is not None and (fault is None or nxt[0] <= fault):
            out.append(Stretch(nxt[0] - t, nxt[1] - step))  # re-formed without a fault
        elif fault is not None:
            after = next(((u, s) for u, s in starts[i + 1:] if u > fault), None)
            if after is None:
                raise IncompleteRunError(f"no generation restored after the fault at {fault}")
            out.append(Stretch(fault - t, after[1] - step - (0.5 - collective_at)))
        else:
            out.append(Stretch(window.end - t, window.steps - step))
    return out


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """The productive step time of a measured run, from its stretches of training."""

    step_s: float
    """Seconds per step over the stretches kept."""
    stretches: int
    """Stretches of training in the run."""
    left_out: int
    """Stretches left out: no step credited, or slower than ``slow_factor`` x the median."""


def productive_step_time(events: Sequence[Mapping[str, Any]], fault_times: Iterable[float] = (),
                         *, collective_at: float = 1.0, slow_factor: float = 1.25,
                         min_steps: float = 10.0) -> StepTime:
    """The fault-free step time of a finished run, from its stretches of training.

    Seconds over steps, pooled over the stretches; a stretch more than
    ``slow_factor`` times slower than the median stretch (of those with at least
    ``min_steps`` steps) is left out: something stalled inside it (a checkpoint
    that blocked training, say), and that is not the step time.

    Raises:
        IncompleteRunError: the run did not finish, or trained no step between faults.
        ConfigError: ``collective_at`` outside [0, 1] or ``slow_factor`` < 1.
    """
    if slow_factor < 1.0:
        raise ConfigError(f"slow_factor={slow_factor} must be >= 1")
    all_ = training_stretches(events, fault_times, collective_at=collective_at)
    credited = [s for s in all_ if s.steps > 0]
    if not credited:
        raise IncompleteRunError("the run trained no step between its faults")
    long_ = [s for s in credited if s.steps >= min_steps] or credited
    median = float(np.median([s.seconds / s.steps for s in long_]))
    kept = [s for s in credited if s.seconds / s.steps <= slow_factor * median]
    return StepTime(step_s=sum(s.seconds for s in kept) / sum(s.steps for s in kept),
                    stretches=len(all_), left_out=len(all_) - len(kept))


def recovery_phases_ms(events: Sequence[Mapping[str, Any]],
                       fault_times: Iterable[float] = ()) -> list[dict[str, float]]:
    """Phase durations (ms, ``PHASE_NAMES``) of each finished recovery, in order.

    ``detect`` is the time from the newest injected fault at or before the
    detection to the detection; it is left out when no fault time precedes it.
    A recovery that a newer fault superseded has no ``recovery_done`` and is skipped.

    Raises:
        IncompleteRunError: a finished recovery lacks one of its phase events.
    """
    faults = sorted(fault_times)
    phases: dict[int, dict[str, float]] = {}
    for e in events:
        if e["kind"] == EventKind.PHASE:
            phases.setdefault(int(e["recovery"]), {})[e["phase"]] = (e["end"] - e["start"]) * 1000.0
    out = []
    for done in (e for e in events if e["kind"] == EventKind.RECOVERY_DONE):
        n = int(done["recovery"])
        row = dict(phases.get(n, {}))
        missing = [p.value for p in RecoveryPhase if p not in row]
        if missing:
            raise IncompleteRunError(f"recovery {n} has no phase event for {missing}")
        before = [f for f in faults if f <= done["detected"]]
        if before:
            row["detect"] = (done["detected"] - before[-1]) * 1000.0
        out.append({p: row[p] for p in PHASE_NAMES if p in row})
    return out


def mean_phases_ms(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Mean of each phase over the rows that have it (``{}`` for no rows)."""
    return {p: float(np.mean([r[p] for r in rows if p in r]))
            for p in PHASE_NAMES if any(p in r for r in rows)}
