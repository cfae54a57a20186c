"""Typed errors: one ``ResilienceError`` base with narrow subclasses.

Callers catch the narrowest class they can handle; anything else propagates.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "ResilienceError",
    "ConfigError",
    "SlurmCommandError",
    "NoSpareError",
    "RecoveryError",
    "RankTableError",
    "StepAborted",
    "CheckpointError",
    "ProtocolError",
    "JobEnded",
    "DataError",
]


class ResilienceError(Exception):
    """Base class of every error raised by slurm_resilience."""


class ConfigError(ResilienceError):
    """A configuration value or file is invalid; the message says how to fix it."""


class SlurmCommandError(ResilienceError):
    """A Slurm command failed, timed out or is not installed.

    Attributes:
        argv: the command line that was run.
        returncode: its exit status, or None when it timed out or never started.
        stderr: its standard error (or a short explanation when it never ran).
    """

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(self._one_line())

    def _one_line(self) -> str:
        cmd = " ".join(self.argv)
        status = "no exit status" if self.returncode is None else f"exit {self.returncode}"
        first = next((ln.strip() for ln in self.stderr.splitlines() if ln.strip()), "")
        return f"`{cmd}` failed ({status}): {first}" if first else f"`{cmd}` failed ({status})"

    def __str__(self) -> str:
        return self._one_line()


class NoSpareError(ResilienceError):
    """A node must be replaced but no usable spare node is left in the job."""


class RecoveryError(ResilienceError):
    """Recovery cannot proceed (illegal lifecycle transition, budget exhausted, ...)."""


class RankTableError(ResilienceError):
    """A rank table is malformed or a regeneration request is inconsistent."""


class StepAborted(ResilienceError):
    """A collective was interrupted by a fault inside a worker.

    Raised inside a worker when a collective is interrupted by a fault; caught by
    the step context, never by users.
    """


class CheckpointError(ResilienceError):
    """A checkpoint could not be written, found, or validated."""


class ProtocolError(ResilienceError):
    """A supervisor/worker message is malformed or carries the wrong token."""


class DataError(ResilienceError, ValueError):
    """Data loading was given bad input: a sampler or loader argument, a position, a rank
    outside the world, an iterable-style dataset. Also a ValueError, as argument errors are."""


class IncompleteRunError(ResilienceError):
    """An event log lacks what a finished run writes (start, done, a recovery's phases)."""


class JobEnded(BaseException):
    """This rank's part in the job is over; not an error, so not a ResilienceError.

    Raised by ``Session.steps()`` between steps (never inside ``with step:``) and by
    ``Session.__enter__`` when the rank is fenced (left out of a newer generation),
    stopped (requeue), done persisting (preemption), aborted, or is a warm standby
    at the job's end. ``Session.__exit__`` turns it into the process's exit with
    :attr:`code`, so code after the ``with Session()`` block (final outputs) runs only
    on ranks that finished training.

    It derives from ``BaseException``, like ``SystemExit``, so that a training loop's
    ``except Exception`` cannot swallow the end of the job; unlike ``SystemExit`` it is
    typed, so the session tells its own endings apart from a user's ``sys.exit()``.

    Attributes:
        code: the process exit status (0 for fenced, stopped, persisted, shut down;
            3 for aborted; the constants are in ``worker/membership.py``).
        reason: one line saying why.
    """

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"job ended for this rank (exit {self.code}): {self.reason}"
