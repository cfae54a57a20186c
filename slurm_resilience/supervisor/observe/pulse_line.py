"""What a node's pulse line (``worker/pulse.py``) says of one rank, as the liveness thread
keeps it: one :class:`Pulse` per rank, read from the line's entry by :func:`pulse_entry`."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Pulse", "pulse_entry"]


class Pulse(NamedTuple):
    """What the node's pulse (``worker/pulse.py``) last said of one rank, received at ``t``.

    A named tuple, not a dataclass: the liveness thread makes N of them a period."""

    t: float
    progress: int
    waiting: bool  # in a bounded wait on its peers or on a plan
    step: int
    state: str  # /proc/PID/stat state letter: R, S, D, T (stopped), ...
    cpu: int  # utime + stime, clock ticks
    busy: bool = False  # in the toolkit's own checkpoint I/O (a restore, a final save)
    # The rank's heartbeat, folded into the line (0 / -1: none yet, or an older pulse).
    beat_t: float = 0.0
    generation: int = -1
    rank: int = -1
    compute_ms: float = -1.0

    def beat(self) -> dict[str, Any] | None:
        """The heartbeat this line carried, in the store heartbeat's form (None: none)."""
        if self.beat_t <= 0:
            return None
        out: dict[str, Any] = {"t": self.beat_t, "step": self.step, "progress": self.progress,
                               "phase": 2 if self.busy else int(self.waiting),
                               "generation": None if self.generation < 0 else self.generation,
                               "rank": None if self.rank < 0 else self.rank}
        if self.compute_ms >= 0:
            out["compute_ms"] = self.compute_ms
        return out


_tuple = tuple.__new__


def pulse_entry(now: float, entry: list) -> Pulse:
    """One rank's entry of a pulse line (``worker/pulse.py``: pid, progress, phase, step, state,
    cpu, beat time, generation, rank, compute ms). The pulse packs them from fixed binary
    fields, so their JSON types are known: a whole entry whose fields the supervisor computes
    with have those types is taken as it is (the liveness thread makes N of these a period:
    no conversion per field, no ``__new__`` call); anything else is converted, or raises for
    the line to be skipped."""
    if len(entry) == 10 and type(entry[3]) is int and type(entry[6]) is float and type(entry[9]) is float:
        ph = entry[2]  # 0 computing, 1 waiting, 2 busy
        return _tuple(Pulse, (now, entry[1], ph == 1, entry[3], entry[4][:1], entry[5], ph == 2, entry[6],
                              entry[7], entry[8], entry[9]))
    _pid, progress, phase, step, st, cpu = entry[:6]
    phase = int(phase)
    beat = entry[6:10] if len(entry) >= 10 else (0.0, -1, -1, -1.0)
    return Pulse(now, int(progress), phase == 1, int(step), str(st)[:1], int(cpu), phase == 2, float(beat[0]),
                 int(beat[1]), int(beat[2]), float(beat[3]))
