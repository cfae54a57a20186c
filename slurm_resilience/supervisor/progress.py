"""The step-progress watchdog: is a quiet rank hung, or only starved?

Three signs per rank, each from a different place:

* the store heartbeat (a thread in the rank's interpreter: needs the GIL and a CPU);
* the pulse (a process of its own, ``worker/pulse.py``): the rank's process state
  from ``/proc`` and the progress counter its main thread bumps in shared memory;
* the progress counter itself, and whether the main thread is waiting on its peers.

A stale heartbeat alone is only a *suspect* (reported, not acted on); a rank is
*hung* when the evidence says so. Rules (:func:`assess`, pure), first match wins:

==========================  =================================  ===========  ==========
pulse                       progress / process state           heartbeat    verdict
==========================  =================================  ===========  ==========
fresh                       stopped (state T)                  stale        HUNG
fresh                       in checkpoint I/O, no progress     any          SLOW after
                            > soft                                          soft, never hung
fresh                       no progress > hard, not waiting    any          HUNG
fresh                       no progress > hard, waiting        any          WAITING¹
fresh                       no progress > soft                 any          SLOW
fresh                       advancing                          stale        SUSPECT
older than vouch, or none   any                                stale        SILENT²
older than the stale time   any                                fresh        SUSPECT
==========================  =================================  ===========  ==========

"fresh" for a pulse is younger than ``Timeouts.vouch_s`` (4 heartbeat periods, at
least 1 s, at most the heartbeat timeout): on a frozen node the pulse and the
heartbeat stop together, so the pulse is long silent when the heartbeat turns stale.

¹ blocked on a peer: not its fault. When every rank with a fresh pulse is past the
  hard timeout and waits (a collective that never returns anywhere), all are HUNG.
² no sign of life at all: the old heartbeat path (the executor probes the node:
  unreachable → node lost, else process hung), so a frozen node costs no more
  than the heartbeat timeout.

The step timeouts come from measured step times (:func:`derive_timeouts`):
soft = max(``progress_soft_s``, factor/2 × longest recent step), hard =
max(``progress_hard_s``, factor × longest recent step).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Mapping, Sequence

__all__ = ["Verdict", "Signs", "Timeouts", "assess", "derive_timeouts", "ProgressWatch"]


class Verdict(enum.Enum):
    """What the watchdog thinks of one rank.

    OK: alive and moving. SUSPECT: one sign of life is late while another says the rank
    lives and moves (a starved heartbeat thread, a GIL held for long): reported only.
    SLOW: no progress past the soft timeout: reported only. WAITING: no progress past
    the hard timeout, but blocked on its peers or the supervisor. HUNG: confirmed; the
    ladder recovers it (PROCESS_HUNG). SILENT: no sign of life at all; the node probe
    decides (node lost or process hung).
    """

    OK = "ok"
    SUSPECT = "suspect"
    SLOW = "slow"
    WAITING = "waiting"
    HUNG = "hung"
    SILENT = "silent"


ACTED_ON = frozenset({Verdict.HUNG, Verdict.SILENT})  # the executor makes these a Suspect


@dataclasses.dataclass(frozen=True)
class Signs:
    """What was seen of one rank. Ages in seconds; None: never seen (no pulse process)."""

    hb_age: float
    pulse_age: float | None = None
    state: str | None = None
    waiting: bool = False
    busy: bool = False  # in the toolkit's own checkpoint I/O: not a step, no step timeout
    stalled_s: float = 0.0  # since the progress counter last changed


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """``stale_s``: heartbeat timeout; ``soft_s``/``hard_s``: step timeouts; ``pulse_s``: a pulse
    older than this no longer vouches for a rank whose heartbeat is stale (shorter than
    ``stale_s``, so a frozen node, where both stop together, is not detected later)."""

    stale_s: float
    soft_s: float
    hard_s: float
    pulse_s: float | None = None  # None: stale_s

    @property
    def vouch_s(self) -> float:
        return self.stale_s if self.pulse_s is None else self.pulse_s


def derive_timeouts(step_times: Sequence[float], *, stale_s: float, soft_s: float, hard_s: float,
                    factor: float, pulse_s: float | None = None) -> Timeouts:
    """Pure: the step timeouts for the recent step times (the floors while none is known)."""
    longest = max(step_times, default=0.0)
    return Timeouts(stale_s=stale_s, soft_s=max(soft_s, factor / 2 * longest), hard_s=max(hard_s, factor * longest),
                    pulse_s=pulse_s)


def assess(signs: Mapping[str, Signs], t: Timeouts) -> dict[str, tuple[Verdict, str]]:
    """Pure: each rank's verdict and the evidence for it (the table above)."""
    out: dict[str, tuple[Verdict, str]] = {}
    past_hard: list[str] = []
    for wid, s in signs.items():
        hb_stale = s.hb_age > t.stale_s
        if s.pulse_age is not None and s.pulse_age <= t.vouch_s:
            if s.state == "T" and hb_stale:
                out[wid] = (Verdict.HUNG, f"process stopped (state T), heartbeat stale for {s.hb_age:.1f} s")
            elif s.busy:
                out[wid] = ((Verdict.SLOW, f"in checkpoint I/O for {s.stalled_s:.1f} s (soft timeout "
                                           f"{t.soft_s:.1f} s)") if s.stalled_s > t.soft_s else (Verdict.OK, ""))
            elif s.stalled_s > t.hard_s:
                past_hard.append(wid)
            elif s.stalled_s > t.soft_s:
                out[wid] = (Verdict.WAITING if s.waiting else Verdict.SLOW,
                            f"no progress for {s.stalled_s:.1f} s (soft timeout {t.soft_s:.1f} s)"
                            + (", waiting on its peers" if s.waiting else ""))
            elif hb_stale:
                out[wid] = (Verdict.SUSPECT, f"heartbeat stale for {s.hb_age:.1f} s, but the process is alive "
                                             f"(state {s.state}) and progressing (pulse fresh)")
            else:
                out[wid] = (Verdict.OK, "")
        elif hb_stale:
            what = "no pulse" if s.pulse_age is None else f"pulse silent for {s.pulse_age:.1f} s"
            out[wid] = (Verdict.SILENT, f"heartbeat stale for {s.hb_age:.1f} s and {what}")
        elif s.pulse_age is not None and s.pulse_age > t.stale_s:
            out[wid] = (Verdict.SUSPECT, f"pulse silent for {s.pulse_age:.1f} s, heartbeat fresh")
        else:
            out[wid] = (Verdict.OK, "")
    culprits = [w for w in past_hard if not signs[w].waiting]
    # "Every rank waits" needs every rank with a fresh pulse past the hard timeout: the culprit
    # may have moved last (it completed the previous step after its peers entered the next
    # collective) and cross the timeout a moment after them.
    everyone = not culprits and all(w in past_hard for w in signs
                                    if signs[w].pulse_age is not None and signs[w].pulse_age <= t.vouch_s)
    for wid in past_hard:
        s = signs[wid]
        if (culprits and s.waiting) or not (culprits or everyone):
            out[wid] = (Verdict.WAITING, f"no progress for {s.stalled_s:.1f} s, waiting on its peers")
        elif culprits:
            out[wid] = (Verdict.HUNG, f"no progress for {s.stalled_s:.1f} s (hard timeout {t.hard_s:.1f} s) "
                                      f"while not waiting on its peers (state {s.state})")
        else:
            out[wid] = (Verdict.HUNG, f"no progress for {s.stalled_s:.1f} s (hard timeout {t.hard_s:.1f} s) "
                                      "on every stalled rank, all waiting: a collective that never returns")
    return out


class ProgressWatch:
    """The watchdog's bookkeeping (when each counter last moved, recent step times);
    the verdicts are :func:`assess`'s. ``now`` is given: testable with a fake clock."""

    def __init__(self, *, stale_s: float, soft_s: float, hard_s: float, factor: float, pulse_s: float | None = None,
                 window: int = 20) -> None:
        self._floors = dict(stale_s=stale_s, soft_s=soft_s, hard_s=hard_s, factor=factor, pulse_s=pulse_s)
        self._moved: dict[str, tuple[int, float]] = {}  # worker → (progress, when it changed)
        self._stepped: dict[str, tuple[int, float]] = {}  # worker → (step, when it was first seen)
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self.verdicts: dict[str, tuple[Verdict, str]] = {}

    def timeouts(self) -> Timeouts:
        return derive_timeouts(self._times, **self._floors)

    def observe(self, hb_t: Mapping[str, float], pulses: Mapping, now: float, *,
                paused: bool = False) -> list[tuple[str, Verdict, Verdict, str]]:
        """Fold in one look at the ranks (``hb_t``: last heartbeat, or start, per rank;
        ``pulses``: ``detect.Pulse`` per worker). ``paused``: a recovery is in flight, so
        a stall is expected: progress clocks restart. Returns the changes of verdict
        ``(worker, old, new, evidence)``."""
        signs: dict[str, Signs] = {}
        for wid, t in hb_t.items():
            p = pulses.get(wid)
            if p is None:
                signs[wid] = Signs(hb_age=now - t)
                continue
            self._note_step(wid, p.step, now, paused)
            last = self._moved.get(wid)
            if paused or last is None or last[0] != p.progress:
                self._moved[wid] = last = (p.progress, now)
            signs[wid] = Signs(hb_age=now - t, pulse_age=now - p.t, state=p.state, waiting=p.waiting,
                               busy=p.busy, stalled_s=now - last[1])
        new = assess(signs, self.timeouts())
        changes = []
        for wid, (verdict, why) in new.items():
            old = self.verdicts.get(wid, (Verdict.OK, ""))[0]
            if verdict is not old:
                changes.append((wid, old, verdict, why))
        self.verdicts = new
        for wid in [w for w in self._moved if w not in hb_t]:  # workers no longer watched
            self._moved.pop(wid, None)
            self._stepped.pop(wid, None)
        return changes

    def _note_step(self, wid: str, step: int, now: float, paused: bool) -> None:
        prev = self._stepped.get(wid)
        if paused or prev is None or step < prev[0]:
            self._stepped[wid] = (step, now)  # a recovery's own pause is not a step time
        elif step > prev[0]:
            self._times.append((now - prev[1]) / (step - prev[0]))
            self._stepped[wid] = (step, now)
