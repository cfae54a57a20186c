"""Pure: which ranks are persistently slower than their peers.

In synchronous data parallel training every rank's step takes as long as the
slowest one, so the step rate cannot tell who is slow. Each rank reports its own
compute time (step start → first collective, an EWMA) in its heartbeat; a rank
whose compute time exceeds ``threshold`` × the median of the others for
``window`` consecutive checks is a straggler.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Mapping

__all__ = ["StragglerPolicy", "slow_ranks", "update_streaks", "stragglers", "StragglerWatch"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerPolicy:
    """When a rank counts as a straggler (``detect.straggler_threshold``/``straggler_window``)."""

    threshold: float = 1.5  # × the median of the other ranks
    window: int = 8  # consecutive checks
    min_ms: float = 1.0  # ignore noise on very short compute times


def slow_ranks(compute_ms: Mapping[int, float], policy: StragglerPolicy) -> set[int]:
    """Ranks slower than ``threshold`` × the median of the others, this check."""
    out = set()
    if len(compute_ms) < 2:
        return out
    for rank, ms in compute_ms.items():
        others = [v for r, v in compute_ms.items() if r != rank]
        ref = statistics.median(others)
        if ms >= policy.min_ms and ms > policy.threshold * max(ref, policy.min_ms / policy.threshold):
            out.add(rank)
    return out


def update_streaks(streaks: Mapping[int, int], slow: set[int], ranks: set[int]) -> dict[int, int]:
    """Consecutive slow checks per rank (reset when a rank is not slow)."""
    return {r: (streaks.get(r, 0) + 1 if r in slow else 0) for r in ranks}


def stragglers(streaks: Mapping[int, int], policy: StragglerPolicy) -> list[int]:
    """Ranks slow for at least ``window`` consecutive checks, in rank order."""
    return sorted(r for r, n in streaks.items() if n >= policy.window)


class StragglerWatch:
    """Streaks across checks; ``observe`` returns ranks that just became stragglers."""

    def __init__(self, policy: StragglerPolicy) -> None:
        self.policy = policy
        self._streaks: dict[int, int] = {}
        self._reported: set[int] = set()
        self._generation: int | None = None

    def observe(self, compute_ms: Mapping[int, float], generation: int | None = None) -> list[int]:
        """One check of every rank's compute time (rank -> ms): the ranks that just became
        stragglers. A new ``generation`` starts the streaks afresh (ranks may be renumbered)."""
        if generation != self._generation:
            self.reset()
            self._generation = generation
        if len(compute_ms) < 2:
            return []
        self._streaks = update_streaks(self._streaks, slow_ranks(compute_ms, self.policy), set(compute_ms))
        new = [r for r in stragglers(self._streaks, self.policy) if r not in self._reported]
        self._reported.update(new)
        return new

    def reset(self) -> None:
        """A new generation: ranks may have been renumbered."""
        self._streaks, self._reported = {}, set()
