"""The life of one process of a ULFM job: one enum, one transition table."""

from __future__ import annotations

import enum

__all__ = ["Phase", "TRANSITIONS", "PhaseError", "transition"]


class Phase(enum.Enum):
    """Where a process of a ULFM job stands.

    ACTIVE: holds a rank of the working communicator and trains.
    PARKED: a spare, waiting in a receive on the world for a fault or the end.
    REPAIRING: inside Revoke -> Shrink -> plan -> Split -> restore -> Agree.
    DONE: the run is over (every active rank completed the last step).
    """

    ACTIVE = "active"
    PARKED = "parked"
    REPAIRING = "repairing"
    DONE = "done"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.ACTIVE: frozenset({Phase.REPAIRING, Phase.DONE}),
    Phase.PARKED: frozenset({Phase.REPAIRING, Phase.DONE}),
    Phase.REPAIRING: frozenset({Phase.ACTIVE, Phase.PARKED}),
    Phase.DONE: frozenset(),
}


class PhaseError(RuntimeError):
    """A transition the table does not allow (a bug in the session, never user input)."""


def transition(current: Phase, new: Phase) -> Phase:
    """Return ``new`` if ``current -> new`` is allowed, else raise PhaseError."""
    if new not in TRANSITIONS[current]:
        raise PhaseError(f"ULFM session: {current.name} -> {new.name} is not a valid transition")
    return new
