"""Parked process groups: a broken generation's group, kept until it can die quickly.

A gloo collective that a fault interrupted keeps running inside gloo until the
group's timeout, and dropping the group's last reference *blocks* until then
(TORCH_ONLINE.md: 7 s with an 8 s timeout). So a recovery parks the old group
(keeps a reference) and builds the next generation at once. Parked groups are
released once they are older than the group timeout, when destroying them is
quick, and from a background thread, so that even a slow destructor never holds
the training loop. A chain of faults therefore holds at most the groups of the
last ``hold_s`` seconds, not every group since the job started.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable


__all__ = ["ParkingLot"]


log = logging.getLogger(__name__)


class ParkingLot:
    """Holds parked objects for ``hold_s`` seconds, then drops them off the caller's thread.

    ``park`` is cheap and never blocks on a destructor. A daemon thread (started by the
    first ``park``) wakes every ``check_s`` seconds and drops what has expired;
    ``release_expired`` is that thread's step, callable directly with an injected clock.
    """

    def __init__(self, hold_s: float, *, check_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s < 0 or check_s <= 0:
            raise ValueError(f"ParkingLot(hold_s={hold_s}, check_s={check_s})")
        self.hold_s = hold_s
        self._check_s = check_s
        self._clock = clock
        self._lock = threading.Lock()
        self._parked: list[tuple[float, object]] = []  # (release time, object), oldest first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def park(self, item: object) -> None:
        """Keep ``item`` alive for ``hold_s`` seconds from now."""
        with self._lock:
            self._parked.append((self._clock() + self.hold_s, item))
            start = self._thread is None and not self._stop.is_set()
            if start:
                self._thread = threading.Thread(target=self._run, name="sr-parking", daemon=True)
        if start:
            self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)

    def release_expired(self) -> int:
        """Drop every object whose hold has passed, in this thread; returns how many."""
        now = self._clock()
        with self._lock:
            due = [item for until, item in self._parked if until <= now]
            self._parked = [(until, item) for until, item in self._parked if until > now]
        n = len(due)
        due.clear()  # the last references die here, outside the lock (a destructor may block)
        if n:
            log.debug("released %d parked group(s)", n)
        return n

    def _run(self) -> None:
        while not self._stop.wait(self._check_s):
            self.release_expired()

    def close(self) -> None:
        """Stop the release thread. What is still parked stays referenced until the
        process exits: dropping it now could block the exit for up to ``hold_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._check_s + 1)
