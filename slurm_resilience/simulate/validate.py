"""Closed-form ETTR and the comparison of a prediction with a measured run.

The closed form places ``n`` faults uniformly and independently in the wall time
``W``; each starts a recovery of ``d`` seconds, and a fault during a recovery
restarts it (as ``simulate`` does), so recoveries overlap instead of adding up.
Counting the window before each point (wrapped around, no edge effects)::

    P(a point is outside every recovery) = (1 - d/W)^n
    faults that hit training              = n (1 - d/W)^(n-1)

    ETTR = [(1 - d/W)^n - n (1 - d/W)^(n-1) * lost / W] * every / (every + cost)

``lost`` = (collective_at - 1/2) * step: half a step is redone when all compute
precedes the collective (``collective_at`` = 1); when it follows the update
(0), the survivors finish the interrupted step during the recovery: half a step
gained back. For ``n d << W`` this is ``1 - n (d + lost) / W``.
"""

from __future__ import annotations

from typing import Mapping

from slurm_resilience.errors import ConfigError

from .failures import FaultClass
from .strategies import PhaseTimes

__all__ = ["expected_ettr", "validate_against_run"]


def expected_ettr(*, wall_s: float, faults: float, downtime_s: float, step_time_s: float,
                  checkpoint_interval_s: float, checkpoint_cost_s: float = 0.0,
                  collective_at: float = 1.0) -> float:
    """Closed form for step-rollback recoveries (see the module docstring).

    Raises:
        ConfigError: a time or count out of range, ``collective_at`` outside [0, 1].
    """
    if (wall_s <= 0 or step_time_s <= 0 or checkpoint_interval_s <= 0 or checkpoint_cost_s < 0
            or faults < 0 or downtime_s < 0 or not 0 <= collective_at <= 1):
        raise ConfigError("wall_s, step_time_s and checkpoint_interval_s must be > 0; faults, downtime_s "
                          "and checkpoint_cost_s >= 0; collective_at within [0, 1]")
    every = max(1, round(checkpoint_interval_s / step_time_s)) * step_time_s
    free = max(0.0, 1.0 - downtime_s / wall_s)
    lost = (collective_at - 0.5) * step_time_s
    hit_training = faults * free ** (faults - 1) if free > 0 else 0.0
    running = max(0.0, free ** faults - hit_training * lost / wall_s)
    return running * every / (every + checkpoint_cost_s)


_OBSERVED_REQUIRED = ("wall_time_s", "faults", "phases_ms", "step_time_s", "checkpoint_interval_s")
_OBSERVED_OPTIONAL = ("checkpoint_cost_s", "fault_class", "collective_at", "productive_time_s", "steps", "ettr")


def validate_against_run(observed: Mapping[str, object]) -> dict[str, object]:
    """Predict a measured run's ETTR from its phase times and compare.

    ``observed`` holds ``wall_time_s``, ``faults`` (injected), ``phases_ms``
    (``{phase: ms}``, see ``PHASE_NAMES``; missing phases take the defaults of
    ``PhaseTimes``), ``step_time_s`` and ``checkpoint_interval_s``; optionally
    ``checkpoint_cost_s`` (default 0), ``fault_class`` (``node``/``process``/``hang``,
    default ``node``; a label: the phases say what the recovery cost),
    ``collective_at`` (default 1, see ``Strategy``) and the observed outcome as
    ``ettr``, ``productive_time_s`` or ``steps`` (completed).

    The phases are the run's own, fault to first completed step, so they already
    hold whatever the recovery took (a restarted process's start, a hang's
    heartbeat time-out): nothing modelled is added. Their ``first_step`` holds one
    step of training, which is productive: the downtime per fault is the phases'
    sum less that step.

    Raises:
        ConfigError: a key is missing or unknown, or a value is out of range.
    """
    missing = [k for k in _OBSERVED_REQUIRED if k not in observed]
    unknown = sorted(set(observed) - set(_OBSERVED_REQUIRED) - set(_OBSERVED_OPTIONAL))
    if missing or unknown:
        raise ConfigError(f"observed run: missing {missing}, unknown {unknown}; "
                          f"valid: {', '.join(_OBSERVED_REQUIRED + _OBSERVED_OPTIONAL)}")
    wall, step = float(observed["wall_time_s"]), float(observed["step_time_s"])  # type: ignore[arg-type]
    faults = int(observed["faults"])  # type: ignore[arg-type]
    collective_at = float(observed.get("collective_at", 1.0))  # type: ignore[arg-type]
    if wall <= 0 or step <= 0 or faults < 0:
        raise ConfigError("wall_time_s and step_time_s must be > 0, faults >= 0")
    phases = PhaseTimes.from_ms(observed["phases_ms"])  # type: ignore[arg-type]
    try:
        cls = FaultClass(observed.get("fault_class", "node"))
    except ValueError:
        raise ConfigError(f"fault_class must be one of {[c.value for c in FaultClass]}") from None
    downtime = phases.online_s - min(phases.first_step, step)
    predicted = expected_ettr(wall_s=wall, faults=faults, downtime_s=downtime, step_time_s=step,
                              checkpoint_interval_s=float(observed["checkpoint_interval_s"]),  # type: ignore[arg-type]
                              checkpoint_cost_s=float(observed.get("checkpoint_cost_s", 0.0)),  # type: ignore[arg-type]
                              collective_at=collective_at)
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
        "expected_lost_work_per_fault_s": (collective_at - 0.5) * step,
        "fault_class": cls.value,
        "faults": faults,
    }
