"""The step-progress watchdog: is a quiet rank hung, or only starved?

Three signs per rank, each from a different place:

* the store heartbeat (a thread in the rank's interpreter: needs the GIL and a CPU);
* the pulse (a process of its own, ``worker/pulse.py``): the rank's process state
  from ``/proc`` and the progress counter its main thread bumps in shared memory;
* the progress counter itself, and whether the main thread is waiting on its peers.

A stale heartbeat alone is only a *suspect* (reported, not acted on); a rank is
*hung* when the evidence says so. The progress counter reaches the supervisor twice:
in every pulse line and in every store heartbeat (the heartbeat thread copies it from
the same page), so a rank whose pulse died still shows whether its main thread moves.
Progress is *seen* when the pulse is fresh or the heartbeat is. Rules (:func:`assess`,
pure), first match wins:

==========================  =================================  ===========  ==========
pulse                       progress / process state           heartbeat    verdict
==========================  =================================  ===========  ==========
fresh                       stopped (state T)                  stale        HUNG
progress seen               in checkpoint I/O, no progress     any          SLOW after
                            > soft                                          soft, never hung
progress seen               no progress > hard, not waiting    any          HUNG
progress seen               no progress > hard, waiting        any          WAITING¹
progress seen               no progress > block, not waiting,  any          HUNG³
                            every other rank waiting
progress seen               no progress > soft                 any          SLOW
fresh                       advancing                          stale        SUSPECT
older than vouch, or none   any                                stale        SILENT²
older than the stale time   advancing                          fresh        SUSPECT
==========================  =================================  ===========  ==========

"fresh" for a pulse is younger than ``Timeouts.vouch_s`` (4 heartbeat periods, at
least 1 s, at most the heartbeat timeout): on a frozen node the pulse and the
heartbeat stop together, so the pulse is long silent when the heartbeat turns stale.
"no progress for X" is evidence, not a guess: X spans two reports (pulse lines or
heartbeats) that showed the same counter, so a late report never lengthens it.

¹ blocked on a peer: not its fault. When every rank whose progress is seen is past
  the hard timeout and waits (a collective that never returns anywhere), all are HUNG.
² no sign of life at all: the old heartbeat path (the executor probes the node:
  unreachable → node lost, else process hung), so a frozen node costs no more
  than the heartbeat timeout.
³ the rank blocks the job: every other rank's progress is seen and it waits on its
  peers (or is blocked too), so nothing moves until this rank does. Only a rank that
  has completed a step since the watch began or the last recovery (its first step
  may compile, warm up, load: the hard timeout judges it); at least one waiting peer.

At scale most ranks are plainly OK at every look: heartbeat and pulse fresh, not in
checkpoint I/O, stalled no longer than every step timeout's floor. No rule can flag such
a rank, so :meth:`ProgressWatch.observe` counts them (:class:`Quiet`: how many are seen,
how many are free of the blocking rule, how many wait) rather than assessing them one by
one; :func:`assess` gives every other rank the verdict it would give with all of them.

The step timeouts come from measured step times (:func:`derive_timeouts`):
soft = max(``progress_soft_s``, factor/2 × longest recent step), block =
max(``progress_block_s``, factor/2 × longest recent step), hard =
max(``progress_hard_s``, factor × longest recent step).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, NamedTuple, Sequence

from ..decide.messages import Verdict  # the decide layer's word; importable from here too

__all__ = ["Verdict", "Signs", "Quiet", "Timeouts", "assess", "derive_timeouts", "progress_in", "ProgressWatch"]


ACTED_ON = frozenset({Verdict.HUNG, Verdict.SILENT})  # the executor makes these a Suspect


class Signs(NamedTuple):
    """What was seen of one rank. Ages in seconds; None: never seen (no pulse process).
    A named tuple, not a frozen dataclass: the watchdog makes N of them a period."""

    hb_age: float
    pulse_age: float | None = None
    state: str | None = None
    waiting: bool = False
    busy: bool = False  # in the toolkit's own checkpoint I/O: not a step, no step timeout
    stalled_s: float = 0.0  # the counter was the same in two reports this far apart
    hb_progress: bool = False  # the heartbeat carries the counter: seen while the heartbeat is fresh
    stepped: bool = False  # completed a step since the watch began or the last recovery


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """``stale_s``: heartbeat timeout; ``soft_s``/``hard_s``: step timeouts; ``pulse_s``: a pulse
    older than this no longer vouches for a rank whose heartbeat is stale (shorter than
    ``stale_s``, so a frozen node, where both stop together, is not detected later);
    ``block_s``: step timeout of a rank every other rank waits on (None: ``hard_s``)."""

    stale_s: float
    soft_s: float
    hard_s: float
    pulse_s: float | None = None  # None: stale_s
    block_s: float | None = None

    @property
    def vouch_s(self) -> float:
        """How old a pulse may be and still vouch for a rank whose heartbeat is stale."""
        return self.stale_s if self.pulse_s is None else self.pulse_s

    @property
    def blocking_s(self) -> float:
        """Step timeout of a rank every other rank waits on (never above ``hard_s``)."""
        return self.hard_s if self.block_s is None else min(self.block_s, self.hard_s)


def derive_timeouts(step_times: Sequence[float], *, stale_s: float, soft_s: float, hard_s: float,
                    factor: float, pulse_s: float | None = None, block_s: float | None = None) -> Timeouts:
    """Pure: the step timeouts for the recent step times (the floors while none is known)."""
    longest = max(step_times, default=0.0)
    hard = max(hard_s, factor * longest)
    return Timeouts(stale_s=stale_s, soft_s=max(soft_s, factor / 2 * longest), hard_s=hard, pulse_s=pulse_s,
                    block_s=None if block_s is None else min(hard, max(block_s, factor / 2 * longest)))


class Quiet(NamedTuple):
    """Ranks left out of :func:`assess`'s ``signs`` because they are plainly OK (heartbeat and
    pulse fresh, not in checkpoint I/O, no stall past the timeouts' floors), counted for the
    rules that look at every rank: ``seen``: their progress is seen; ``free``: unseen, or
    neither waiting nor stuck (nobody's blocker can be waited on by all); ``waiting``: seen
    and waiting on their peers."""

    seen: int = 0
    free: int = 0
    waiting: int = 0


def assess(signs: Mapping[str, Signs], t: Timeouts, quiet: Quiet = Quiet()) -> dict[str, tuple[Verdict, str]]:
    """Pure: each rank's verdict and the evidence for it (the table above); ``quiet``: the
    plainly OK ranks left out of ``signs`` (:class:`Quiet`), OK whatever the others show."""
    out: dict[str, tuple[Verdict, str]] = {}
    past_hard: list[str] = []
    fresh = {w: s.pulse_age is not None and s.pulse_age <= t.vouch_s for w, s in signs.items()}
    seen = {w: fresh[w] or (s.hb_progress and s.hb_age <= t.stale_s) for w, s in signs.items()}
    for wid, s in signs.items():
        hb_stale = s.hb_age > t.stale_s
        if fresh[wid] and s.state == "T" and hb_stale:
            out[wid] = (Verdict.HUNG, f"process stopped (state T), heartbeat stale for {s.hb_age:.1f} s")
        elif seen[wid] and s.busy:
            out[wid] = ((Verdict.SLOW, f"in checkpoint I/O for {s.stalled_s:.1f} s (soft timeout "
                                       f"{t.soft_s:.1f} s)") if s.stalled_s > t.soft_s else (Verdict.OK, ""))
        elif seen[wid] and s.stalled_s > t.hard_s:
            past_hard.append(wid)
        elif seen[wid] and s.stalled_s > t.soft_s:
            out[wid] = (Verdict.WAITING if s.waiting else Verdict.SLOW,
                        f"no progress for {s.stalled_s:.1f} s (soft timeout {t.soft_s:.1f} s)"
                        + (", waiting on its peers" if s.waiting else ""))
        elif fresh[wid] and hb_stale:
            out[wid] = (Verdict.SUSPECT, f"heartbeat stale for {s.hb_age:.1f} s, but the process is alive "
                                         f"(state {s.state}) and progressing (pulse fresh)")
        elif hb_stale:
            what = "no pulse" if s.pulse_age is None else f"pulse silent for {s.pulse_age:.1f} s"
            out[wid] = (Verdict.SILENT, f"heartbeat stale for {s.hb_age:.1f} s and {what}")
        elif s.pulse_age is not None and s.pulse_age > t.stale_s:
            out[wid] = (Verdict.SUSPECT, f"pulse silent for {s.pulse_age:.1f} s, heartbeat fresh")
        else:
            out[wid] = (Verdict.OK, "")
    culprits = [w for w in past_hard if not signs[w].waiting]
    # "Every rank waits" needs every rank whose progress is seen past the hard timeout: the culprit
    # may have moved last (it completed the previous step after its peers entered the next
    # collective) and cross the timeout a moment after them.
    everyone = not culprits and not quiet.seen and all(w in past_hard for w in signs if seen[w])
    for wid in past_hard:
        s = signs[wid]
        if (culprits and s.waiting) or not (culprits or everyone):
            out[wid] = (Verdict.WAITING, f"no progress for {s.stalled_s:.1f} s, waiting on its peers")
        elif culprits:
            out[wid] = (Verdict.HUNG, f"no progress for {s.stalled_s:.1f} s (hard timeout {t.hard_s:.1f} s) "
                                      f"while not waiting on its peers{_where(s, fresh[wid])}")
        else:
            out[wid] = (Verdict.HUNG, f"no progress for {s.stalled_s:.1f} s (hard timeout {t.hard_s:.1f} s) "
                                      "on every stalled rank, all waiting: a collective that never returns")
    for wid in _blockers(signs, seen, t, quiet):
        s = signs[wid]
        out[wid] = (Verdict.HUNG, f"no progress for {s.stalled_s:.1f} s (blocking timeout {t.blocking_s:.1f} s), "
                                  f"not waiting, while every other rank waits on its peers{_where(s, fresh[wid])}")
    return out


def progress_in(beat: Mapping | None) -> tuple[int, int, int] | None:
    """Pure: ``(progress, phase, step)`` a heartbeat carries (``worker/heartbeat.py``); None
    for a beat without them (none yet, or a rank of an older version) or a malformed one."""
    try:
        return (int(beat["progress"]), int(beat["phase"]), int(beat["step"])) if beat and "progress" in beat else None
    except (KeyError, TypeError, ValueError):
        return None


def _blockers(signs: Mapping[str, Signs], seen: Mapping[str, bool], t: Timeouts, quiet: Quiet) -> list[str]:
    """Pure: the ranks the whole job waits on (rule ³), not yet past the hard timeout.

    Stuck: progress seen, neither waiting nor in checkpoint I/O, no progress past the
    blocking timeout. The job is blocked on them when every rank's progress is seen
    and each one waits or is stuck, and at least one waits (a peer to block)."""
    stuck = {w for w, s in signs.items()
             if seen[w] and not s.waiting and not s.busy and s.stalled_s > t.blocking_s}
    if not stuck or quiet.free or not all(seen[w] and (s.waiting or w in stuck) for w, s in signs.items()):
        return []
    if not quiet.waiting and not any(s.waiting for s in signs.values()):
        return []
    return [w for w in stuck if signs[w].stepped and signs[w].stalled_s <= t.hard_s]


def _where(s: Signs, fresh: bool) -> str:
    """Where the progress was seen: the pulse (with the process state) or only the heartbeat."""
    if fresh:
        return f" (state {s.state})"
    what = "no pulse" if s.pulse_age is None else f"pulse silent for {s.pulse_age:.1f} s"
    return f" (progress from its heartbeat; {what})"


class ProgressWatch:
    """The watchdog's bookkeeping (when each counter last moved, recent step times, who
    has completed a step); the verdicts are :func:`assess`'s. ``now`` is given:
    testable with a fake clock."""

    def __init__(self, *, stale_s: float, soft_s: float, hard_s: float, factor: float, pulse_s: float | None = None,
                 block_s: float | None = None, window: int = 20) -> None:
        self._floors = dict(stale_s=stale_s, soft_s=soft_s, hard_s=hard_s, factor=factor, pulse_s=pulse_s,
                            block_s=block_s)
        self._moved: dict[str, tuple[int, float]] = {}  # worker → (progress, first report showing it)
        self._stepped: dict[str, tuple[int, float]] = {}  # worker → (step, when it was first seen)
        self._warm: set[str] = set()  # completed a step since it was first seen or the last recovery
        self._times: collections.deque[float] = collections.deque(maxlen=window)
        self.verdicts: dict[str, tuple[Verdict, str]] = {}
        self._flagged: set[str] = set()  # the ranks whose verdict at the last look was not OK
        self._latest: float | None = None  # the newest move of any rank at the last look (None: one unseen)
        # A rank stalled no longer than every timeout's floor is within every derived timeout:
        # with fresh signs and no checkpoint I/O it is OK whatever the others show (Quiet).
        floor = min(soft_s, hard_s, hard_s if block_s is None else block_s)
        self._calm = (stale_s, stale_s if pulse_s is None else pulse_s, floor)

    def timeouts(self) -> Timeouts:
        """The timeouts now, from the step times measured so far (:func:`derive_timeouts`)."""
        return derive_timeouts(self._times, **self._floors)

    def observe(self, hb_t: Mapping[str, float], pulses: Mapping, now: float, *, paused: bool = False,
                hb_progress: Mapping[str, tuple[int, int, int]] | None = None,
                ) -> list[tuple[str, Verdict, Verdict, str]]:
        """Fold in one look at the ranks (``hb_t``: last heartbeat, or start, per rank;
        ``pulses``: ``detect.Pulse`` per worker; ``hb_progress``: ``(progress, phase, step)``
        carried by a rank's newest heartbeat, phase as in ``worker/pulse.py``). ``paused``:
        a recovery is in flight, so a stall is expected: progress clocks restart.
        Returns the changes of verdict ``(worker, old, new, evidence)``."""
        signs: dict[str, Signs] = {}
        quiet: list[str] = []  # plainly OK: not assessed one by one, counted (Quiet)
        q_seen = q_free = q_wait = 0
        stale_s, vouch_s, calm_s = self._calm
        carried = hb_progress or {}
        latest: float | None = 0.0 if hb_t else None
        moved, stepped, warm = self._moved, self._stepped, self._warm
        for wid, t in hb_t.items():
            p = pulses.get(wid)
            h = carried.get(wid)
            if h is None and p is not None:  # the common case at scale: the beat came in the pulse line
                when = first = p.t
                value, step, phase = p.progress, p.step, 1 if p.waiting else 2 if p.busy else 0
            elif p is None and h is None:
                signs[wid] = Signs(now - t)
                latest = None
                continue
            else:
                # (when, progress, phase, step): the pulse's line and the heartbeat's copy of one
                # counter; the higher progress is the newer report (written out: O(N) per poll).
                pr = None if p is None else (p.t, p.progress, 1 if p.waiting else 2 if p.busy else 0, p.step)
                hr = (t, h[0], h[1], h[2])
                if pr is None:
                    when, value, phase, step = hr
                    first = when
                else:
                    step = pr[3] if pr[3] >= hr[3] else hr[3]
                    if pr[1] != hr[1]:
                        newest = pr if pr[1] > hr[1] else hr
                        first = newest[0]
                    else:
                        newest = pr if pr[0] >= hr[0] else hr
                        first = pr[0] if pr[0] <= hr[0] else hr[0]
                    when, value, phase = newest[0], newest[1], newest[2]
            prev = stepped.get(wid)
            if paused or prev is None or step != prev[0]:  # the common case (same step) costs no call
                self._note_step(wid, step, now, paused)
            last = moved.get(wid)
            if paused or last is None or last[0] != value:
                moved[wid] = last = (value, when if paused else first)
            if latest is not None and last[1] > latest:
                latest = last[1]
            hb_age, pulse_age, stalled = now - t, None if p is None else now - p.t, when - last[1]
            if hb_age <= stale_s and phase != 2 and stalled <= calm_s and (pulse_age is None or pulse_age <= stale_s):
                quiet.append(wid)  # the common case at scale: one test, no Signs, no assessment
                if h is not None or (pulse_age is not None and pulse_age <= vouch_s):  # its progress is seen
                    q_seen += 1
                    q_wait += phase == 1
                    q_free += phase != 1
                else:
                    q_free += 1
                continue
            # positional, in Signs' field order (keywords cost a dict per rank)
            signs[wid] = Signs(hb_age, pulse_age, None if p is None else p.state, phase == 1, phase == 2,
                               max(0.0, stalled), h is not None, wid in warm)
        self._latest = latest
        new = assess(signs, self.timeouts(), Quiet(q_seen, q_free, q_wait))
        changes = []
        for wid, (verdict, why) in new.items():
            old = self.verdicts.get(wid, (Verdict.OK, ""))[0]
            if verdict is not old:
                changes.append((wid, old, verdict, why))
        changes += [(w, self.verdicts[w][0], Verdict.OK, "") for w in self._flagged if w in hb_t and w not in new]
        self._flagged = {w for w, (v, _) in new.items() if v is not Verdict.OK}
        self.verdicts = dict.fromkeys(quiet, (Verdict.OK, ""))
        self.verdicts.update(new)
        if len(moved) > len(hb_t):  # every watched worker has an entry: more means some left
            for wid in [w for w in moved if w not in hb_t]:  # workers no longer watched
                moved.pop(wid, None)
                stepped.pop(wid, None)
                warm.discard(wid)
        return changes

    def flagged(self) -> dict[str, tuple[Verdict, str]]:
        """The verdicts of the last look that are not OK (few; the rest are OK)."""
        return {w: self.verdicts[w] for w in self._flagged}

    def stalled_s(self, now: float) -> float:
        """How long every rank of the last look has shown the same progress (0: one of them
        never seen, or no rank). O(1): kept by :meth:`observe`."""
        return 0.0 if self._latest is None else max(0.0, now - self._latest)

    def longest_step_s(self) -> float:
        """The longest recent step time (0: none measured yet)."""
        return max(self._times, default=0.0)

    def _note_step(self, wid: str, step: int, now: float, paused: bool) -> None:
        prev = self._stepped.get(wid)
        if paused or prev is None or step < prev[0]:
            self._stepped[wid] = (step, now)  # a recovery's own pause is not a step time
            if paused:
                self._warm.discard(wid)  # its next step may rebuild, reload, recompile
        elif step > prev[0]:
            self._times.append((now - prev[1]) / (step - prev[0]))
            self._stepped[wid] = (step, now)
            self._warm.add(wid)
