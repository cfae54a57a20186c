"""Pure: the phases of one recovery, from the supervisor's marks and the ranks' events.

Phases of one recovery, from the supervisor's marks and the ranks' events::

    detected ─classify─ classified ─replace─ replaced ─ranktable─ published
        ─reconnect─ last rank joined ─restore─ last rank restored ─first_step─ last rank stepped

The status file both executors write is ``adapters/status.py``'s.
"""

from __future__ import annotations

from typing import Mapping

from ...protocol import RecoveryPhase


def recovery_phases(marks: Mapping[str, float],
                    worker_marks: Mapping[str, Mapping[int, float]]) -> list[tuple[RecoveryPhase, float, float]]:
    """Pure: (phase, start, end) for a finished recovery; the last rank sets each end."""
    last = {k: max(v.values()) for k, v in worker_marks.items() if v}
    m = marks
    joined = last.get("reconnected", m["published"])
    restored = last.get("restored", joined)
    return [(RecoveryPhase.CLASSIFY, m["detected"], m["classified"]),
            (RecoveryPhase.REPLACE, m["classified"], m["replaced"]),
            (RecoveryPhase.RANKTABLE, m["replaced"], m["published"]),
            (RecoveryPhase.RECONNECT, m["published"], joined),
            (RecoveryPhase.RESTORE, joined, restored),
            (RecoveryPhase.FIRST_STEP, restored, last["first_step"])]
