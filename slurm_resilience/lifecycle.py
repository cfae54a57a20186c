"""The job's lifecycle as an explicit state machine: its phases and the allowed moves.

Every change of phase is a decision (``supervisor/decide/actions.py`` ``move``), which
checks the ``TRANSITIONS`` table and raises ``RecoveryError`` on any other move.
"""

from __future__ import annotations

import enum

__all__ = ["JobPhase", "TRANSITIONS"]


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
