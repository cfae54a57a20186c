"""Errors of the MPI (ULFM) path; each is a ``ResilienceError``."""

from __future__ import annotations

from ..errors import RecoveryError, ResilienceError

__all__ = ["UlfmUnavailableError", "StateLostError", "StateMismatchError"]


class UlfmUnavailableError(ResilienceError):
    """The MPI in use cannot repair a communicator (no ULFM, or not enabled at launch)."""


class StateLostError(RecoveryError):
    """A rank's state is gone: the rank and the buddy holding its copy were both lost."""


class StateMismatchError(ResilienceError):
    """The registered state differs between ranks in a way a copy cannot carry
    (another number of arrays, other shapes or dtypes)."""
