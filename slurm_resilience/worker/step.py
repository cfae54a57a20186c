"""One training step as the user's loop sees it, and its compute time."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import StepAborted
from .rollback import ResumableSampler

if TYPE_CHECKING:
    from ..data.loader import ResumableLoader


__all__ = ["Step", "ComputeTime"]


class Step:
    """One training step; use as ``with step:`` so an interrupted step is redone.

    Attributes: ``index`` (the step number), ``rank`` and ``world_size`` (of the
    generation running it), ``position`` (global samples consumed before it),
    ``replay`` (True when the job completed this step index before: it is redone after
    a rollback; skip logging it).

    ``on_fault``: called with an exception other than StepAborted that leaves the step;
    it returns the StepAborted that replaces it (a failed collective the supervisor
    answers with a new generation) or None (the exception propagates).
    """

    def __init__(self, session, index: int, *, replay: bool = False,
                 on_fault: Callable[[BaseException], StepAborted | None] | None = None) -> None:
        self.index = index
        self.replay = replay
        self._on_fault = on_fault
        self.rank = session.rank
        self.world_size = session.world_size
        self.position = session.position
        self.consumed = 0
        self.aborted: StepAborted | None = None
        self.entered = False
        self.started: float | None = None  # until the first collective (ComputeTime)

    def samples(self, sampler: ResumableSampler) -> list[int]:
        """This rank's sample indices for this step (from the exact global sample position)."""
        self.consumed = sampler.batch_size(self.world_size)
        return sampler.indices_at(self.position, self.rank)

    def batch(self, loader: "ResumableLoader") -> Any:
        """This rank's collated batch for this step (``loader.batch_at`` at this step's
        global sample position); like ``samples``, it sets how many samples the step consumes."""
        out = loader.batch_at(self.position, self.rank, self.world_size)
        self.consumed = loader.sampler.batch_size(self.world_size)
        return out

    def __enter__(self) -> "Step":
        self.entered = True
        self.started = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            return False
        if issubclass(exc_type, StepAborted):
            self.aborted = exc
            return True
        if self._on_fault is not None and issubclass(exc_type, Exception):
            aborted = self._on_fault(exc)
            if aborted is not None:
                self.aborted = aborted
                return True
        return False


class ComputeTime:
    """Smoothed time from a step's start to its first collective: this rank's own
    compute, which tells a straggler apart (the step time is the same on every rank)."""

    def __init__(self) -> None:
        self.ms: float | None = None

    def note(self, step: Step | None) -> float | None:
        """At a collective: fold in the step's compute time once; returns the new
        average, or None when there is nothing new (no step, or not its first collective)."""
        if step is None or step.started is None:
            return None
        ms = (time.perf_counter() - step.started) * 1000
        step.started = None  # once per step: later collectives include the first
        self.ms = ms if self.ms is None else 0.7 * self.ms + 0.3 * ms
        return self.ms
