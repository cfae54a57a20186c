"""Checkpoint intervals sized from cost and failure rate: Young, Daly, and the online estimator.

An ``auto`` tier (:class:`~.tiers.TierSpec`) checkpoints every
:meth:`IntervalEstimator.interval_steps` steps: Daly's optimum for the measured
checkpoint cost (the training stall, an EWMA), the measured step time, and the mean
time between failures (configured until two failures were observed).
"""

from __future__ import annotations

import math
import time
from typing import Callable

from slurm_resilience.errors import ConfigError

__all__ = ["young_daly_interval", "daly_interval", "auto_steps", "IntervalEstimator"]


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints: ``sqrt(2 C M)``.

    J. W. Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974; C = checkpoint cost, M = mean time between failures (seconds).

    Raises:
        ConfigError: C < 0 or M <= 0.
    """
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints.

    ``sqrt(2CM) * (1 + sqrt(C/(2M))/3 + C/(18M)) - C`` for ``C < 2M``, else ``M``.
    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", FGCS 22(3), 2006.

    Raises:
        ConfigError: C < 0 or M <= 0.
    """
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    c, m = checkpoint_cost_s, mtbf_s
    if c >= 2.0 * m:
        return m
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c


def auto_steps(cost_s: float, mtbf_s: float, step_time_s: float) -> int:
    """Daly's interval in whole training steps (rounded down, at least 1).

    Raises:
        ConfigError: cost < 0, mtbf <= 0 or step_time <= 0.
    """
    if not step_time_s > 0:
        raise ConfigError(f"step_time_s={step_time_s} must be > 0")
    return max(1, int(daly_interval(cost_s, mtbf_s) // step_time_s))


def _check_cost_mtbf(cost: float, mtbf: float) -> None:
    if not cost >= 0:
        raise ConfigError(f"checkpoint cost {cost} s must be >= 0")
    if not mtbf > 0:
        raise ConfigError(f"mtbf {mtbf} s must be > 0")


class IntervalEstimator:
    """Online ``auto`` interval: EWMA of checkpoint cost and step time, observed MTBF.

    MTBF is ``elapsed / failures`` (elapsed since construction, by the injected
    clock) once at least two failures were observed, else the configured
    ``mtbf_s``. Until one checkpoint and one step were observed,
    :meth:`interval_steps` returns ``initial_steps``. Deterministic given the clock.
    """

    def __init__(
        self,
        *,
        mtbf_s: float,
        initial_steps: int = 100,
        alpha: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises: ConfigError: mtbf_s <= 0, initial_steps < 1 or alpha outside (0, 1]."""
        if not mtbf_s > 0:
            raise ConfigError(f"mtbf_s={mtbf_s} must be > 0")
        if initial_steps < 1:
            raise ConfigError(f"initial_steps={initial_steps} must be >= 1")
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha={alpha} must be in (0, 1]")
        self._mtbf_s = mtbf_s
        self._initial = initial_steps
        self._alpha = alpha
        self._clock = clock
        self._start = clock()
        self._cost: float | None = None
        self._step: float | None = None
        self._failures: list[float] = []

    def _ewma(self, old: float | None, x: float) -> float:
        return x if old is None else self._alpha * x + (1 - self._alpha) * old

    def observe_checkpoint(self, cost_s: float) -> None:
        """Record the blocking cost of one checkpoint (seconds, >= 0)."""
        if not cost_s >= 0:
            raise ConfigError(f"checkpoint cost {cost_s} s must be >= 0")
        self._cost = self._ewma(self._cost, cost_s)

    def observe_step(self, duration_s: float) -> None:
        """Record the duration of one training step (seconds, > 0)."""
        if not duration_s > 0:
            raise ConfigError(f"step duration {duration_s} s must be > 0")
        self._step = self._ewma(self._step, duration_s)

    def observe_failure(self, t: float | None = None) -> None:
        """Record a failure at clock time ``t`` (default: now)."""
        self._failures.append(self._clock() if t is None else t)

    def mtbf_s(self) -> float:
        """Observed MTBF after >= 2 failures, else the configured one."""
        if len(self._failures) < 2:
            return self._mtbf_s
        elapsed = max(self._clock(), self._failures[-1]) - self._start
        return max(elapsed, 1e-9) / len(self._failures)

    def interval_steps(self) -> int:
        """Steps between checkpoints per :func:`auto_steps` (>= 1)."""
        if self._cost is None or self._step is None:
            return self._initial
        return auto_steps(self._cost, self.mtbf_s(), self._step)
