"""What fails and how often: fault classes, failure categories, the Poisson model.

Default rates: Dubey et al. (Meta), "The Llama 3 Herd of Models", arXiv:2407.21783
(2024), Table 5: root causes of the 419 unexpected interruptions in a 54-day snapshot
of Llama 3 405B pre-training on 16,384 H100 GPUs (8 per server). The counts below are
the table's, category by category (checked against the table as reproduced at
https://glennklockwood.com/garden/component-reliability and the figures quoted by
datacenterdynamics.com); they add up to 419 (tests/unit/test_goodput.py checks it). Shares are taken from the
counts: the table prints 30.1% for Faulty GPU where 148/419 is 35.3% (its printed
percentages add up to 94.9%); every other row's percentage agrees with its count.
The fault class of each category (node, process or hang) is this toolkit's reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from slurm_resilience.errors import ConfigError

__all__ = ["DAY_S", "FaultClass", "FailureCategory", "LLAMA3_CATEGORIES", "LLAMA3_TABLE5", "LLAMA3_INTERRUPTIONS", "FailureModel", "Cluster"]

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
    """One root-cause category of interruptions and its share."""

    name: str
    """Root-cause category as named in the source."""
    share: float
    """Fraction of all unexpected interruptions (normalised over the model)."""
    fault_class: FaultClass
    """Node, process or hang fault."""


_N, _P, _H = FaultClass.NODE, FaultClass.PROCESS, FaultClass.HANG
LLAMA3_INTERRUPTIONS = 419
# (category as in Table 5, lower-cased; interruptions in the 54 days, fault class)
LLAMA3_TABLE5: tuple[tuple[str, int, FaultClass], ...] = (
    ("faulty GPU", 148, _N),
    ("GPU HBM3 memory", 72, _N),
    ("software bug", 54, _P),
    ("network switch/cable", 35, _N),
    ("host maintenance", 32, _N),
    ("GPU SRAM memory", 19, _N),
    ("GPU system processor", 17, _N),
    ("NIC", 7, _N),
    ("NCCL watchdog timeouts", 7, _H),
    ("silent data corruption", 6, _N),
    ("GPU thermal interface + sensor", 6, _N),
    ("SSD", 3, _N),
    ("power supply", 3, _N),
    ("server chassis", 2, _N),
    ("IO expansion board", 2, _N),
    ("dependency", 2, _P),
    ("CPU", 2, _N),
    ("system memory", 2, _N),
)
LLAMA3_CATEGORIES: tuple[FailureCategory, ...] = tuple(
    FailureCategory(name=n, share=count / LLAMA3_INTERRUPTIONS, fault_class=c) for n, count, c in LLAMA3_TABLE5
)


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Poisson failure rates per category, scaled from a reference run to a job's GPU count."""

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
    """The simulated job's GPUs and how they group into nodes."""

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
