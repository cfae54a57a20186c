"""The job's lifecycle as an explicit state machine.

Every change of phase goes through ``Lifecycle.transition``, which checks the
``TRANSITIONS`` table, logs, and records history.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable

from slurm_resilience.errors import RecoveryError

__all__ = ["JobPhase", "TRANSITIONS", "Lifecycle"]

log = logging.getLogger(__name__)


class JobPhase(enum.Enum):
    """Where the job is, as seen by the supervisor."""

    STARTING = "starting"
    """Workers are being launched and have not all registered yet."""

    RUNNING = "running"
    """Every rank of the current rank table is training."""

    RECOVERING = "recovering"
    """A fault was detected; ranks are stopped, replaced and reconnected in-job."""

    FALLBACK_RELAUNCH = "fallback_relaunch"
    """In-job recovery failed; the workers are relaunched from the last checkpoint."""

    FINISHING = "finishing"
    """Training ended; final checkpoint and shutdown are in progress."""

    SUCCEEDED = "succeeded"
    """Terminal: the job finished normally."""

    FAILED = "failed"
    """Terminal: the job could not continue."""


TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.STARTING: frozenset({JobPhase.RUNNING, JobPhase.FAILED}),
    JobPhase.RUNNING: frozenset({JobPhase.RECOVERING, JobPhase.FINISHING, JobPhase.FAILED}),
    JobPhase.RECOVERING: frozenset({JobPhase.RUNNING, JobPhase.FALLBACK_RELAUNCH, JobPhase.FAILED}),
    JobPhase.FALLBACK_RELAUNCH: frozenset({JobPhase.RUNNING, JobPhase.FAILED}),
    JobPhase.FINISHING: frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED}),
    JobPhase.SUCCEEDED: frozenset(),
    JobPhase.FAILED: frozenset(),
}


class Lifecycle:
    """Holds the current ``phase`` and the ``history`` of (time, from, to, reason)."""

    def __init__(
        self,
        phase: JobPhase = JobPhase.STARTING,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.phase = phase
        self.history: list[tuple[float, JobPhase, JobPhase, str]] = []
        self._clock = clock

    @property
    def terminal(self) -> bool:
        """True in SUCCEEDED or FAILED."""
        return not TRANSITIONS[self.phase]

    def transition(self, to: JobPhase, reason: str = "") -> None:
        """Move to ``to``.

        Raises:
            RecoveryError: ``to`` is not allowed from the current phase.
        """
        if to not in TRANSITIONS[self.phase]:
            raise RecoveryError(
                f"illegal job phase transition {self.phase.name} -> {to.name}"
                + (f" ({reason})" if reason else "")
            )
        log.info("job phase %s -> %s%s", self.phase.name, to.name, f": {reason}" if reason else "")
        self.history.append((self._clock(), self.phase, to, reason))
        self.phase = to
