"""What fails and how often: fault classes, failure categories, the Poisson model.

Default rates: Meta, "The Llama 3 Herd of Models" (2024), Table 5 — 419 unexpected
interruptions in 54 days of pre-training on 16,384 H100 GPUs. The per-category
shares below are recalled, not copied: they sum to 94.5%, so they are normalised
to 419 in all. Check them against the paper before quoting.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from slurm_resilience.errors import ConfigError

__all__ = ["DAY_S", "FaultClass", "FailureCategory", "LLAMA3_CATEGORIES", "FailureModel", "Cluster"]

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
