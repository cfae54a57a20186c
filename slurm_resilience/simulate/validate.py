"""Closed-form ETTR and the comparison of a prediction with a measured run."""

from __future__ import annotations

from typing import Mapping

from slurm_resilience.errors import ConfigError

from .failures import FaultClass
from .strategies import CheckpointSpec, PhaseTimes, toolkit_default

__all__ = ["expected_ettr", "validate_against_run"]


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
