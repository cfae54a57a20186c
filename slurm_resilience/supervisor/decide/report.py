"""Pure: the phases of one recovery, from the supervisor's marks and the ranks' events.

Phases of one recovery, from the supervisor's marks and the ranks' events::

    detected ─classify─ classified ─replace─ replaced ─ranktable─ published
        ─reconnect─ last rank joined ─restore─ last rank restored ─first_step─ last rank stepped

The status file both executors write is ``adapters/status.py``'s.
"""

from __future__ import annotations

import enum
from typing import Mapping

from ...protocol import RecoveryPhase


class Mark(str, enum.Enum):
    """A moment of one recovery (``Recovery.marks``: the supervisor's, one time each;
    ``Recovery.worker_marks``: the ranks', one time per rank). Kept in memory only."""

    DETECTED = "detected"
    """The earliest fault of the incident was observed."""
    CLASSIFIED = "classified"
    """The faults were classified and a level chosen."""
    REPLACED = "replaced"
    """Spares or new processes were picked for the lost slots."""
    PUBLISHED = "published"
    """The new plan (rank table) is in the store, or the relaunched step started."""
    RECONNECTED = "reconnected"
    """A rank joined the new generation's process group."""
    RESTORED = "restored"
    """A rank restored its state."""
    FIRST_STEP = "first_step"
    """A rank trained its first step in the new generation (or finished)."""


def recovery_phases(marks: Mapping[Mark, float],
                    worker_marks: Mapping[Mark, Mapping[int, float]]) -> list[tuple[RecoveryPhase, float, float]]:
    """Pure: (phase, start, end) for a finished recovery; the last rank sets each end."""
    last = {k: max(v.values()) for k, v in worker_marks.items() if v}
    m = marks
    joined = last.get(Mark.RECONNECTED, m[Mark.PUBLISHED])
    restored = last.get(Mark.RESTORED, joined)
    return [(RecoveryPhase.CLASSIFY, m[Mark.DETECTED], m[Mark.CLASSIFIED]),
            (RecoveryPhase.REPLACE, m[Mark.CLASSIFIED], m[Mark.REPLACED]),
            (RecoveryPhase.RANKTABLE, m[Mark.REPLACED], m[Mark.PUBLISHED]),
            (RecoveryPhase.RECONNECT, m[Mark.PUBLISHED], joined),
            (RecoveryPhase.RESTORE, joined, restored),
            (RecoveryPhase.FIRST_STEP, restored, last[Mark.FIRST_STEP])]


__all__ = ["Mark", "recovery_phases"]
