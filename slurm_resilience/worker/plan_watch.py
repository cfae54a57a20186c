"""Is plan g out? Asked at every safe point and every poll of a bounded wait.

The supervisor publishes ``plan/{g}`` in the store and then sends it to the pulse of
every node in it (``{"plan": g, "body": ...}`` on its liveness connection), which keeps
the plan in the node's pulse directory and writes g into each rank's page
(``pulse.TOLD``, ``notices.py``). A rank reads its page first: a memory read, no round
trip; and then the plan from that directory (:meth:`PlanWatch.text`), the store's copy
only when the node has none. It asks
the store only when its pulse is not relaying (none running, or its line not sent for
two heartbeat periods: the notice may never come) and, as a safety net for a notice
lost on the way, once every ``STORE_FALLBACK_S`` otherwise. So the store sees N reads
of each plan rather than N checks every poll, and the plan reaches every rank of a
node one pulse wake-up after it is published (docs/scale.md).

:func:`look` is the pure rule; :class:`PlanWatch` carries it out for one thread (its
store client is that thread's own).
"""

from __future__ import annotations

import enum
import os
import time
from typing import Any

from ..protocol import StoreKey
from .notices import plan_path


__all__ = ["STORE_FALLBACK_S", "Look", "look", "PlanWatch"]


STORE_FALLBACK_S = 1.0  # the store is asked at least this often even while the pulse relays


class Look(enum.Enum):
    """OUT: the plan is published. ENDED: the job is over. WAIT: not yet, and the page
    is trusted for now. ASK: ask the store (no pulse relays, or the fallback is due)."""

    OUT = "out"
    ENDED = "ended"
    WAIT = "wait"
    ASK = "ask"


def look(g: int, told: int, ended: bool, relayed_age_s: float, asked_age_s: float, *,
         period_s: float, fallback_s: float = STORE_FALLBACK_S) -> Look:
    """Pure: what a rank waiting for plan ``g`` does, given its page (``told``: the newest
    generation its pulse was told of, ``ended``: the job's end was told), how long ago
    its pulse last relayed its entry, and how long ago it last asked the store."""
    if told >= g:
        return Look.OUT
    if ended:
        return Look.ENDED
    if relayed_age_s <= 2 * period_s and asked_age_s < fallback_s:
        return Look.WAIT
    return Look.ASK


class PlanWatch:
    """One thread's view of the plans: its store client and the rank's page (``board``,
    a ``progress_page.ProgressBoard``; its heartbeat period ``period_s``)."""

    def __init__(self, store: Any, board: Any, period_s: float, fallback_s: float = STORE_FALLBACK_S) -> None:
        self._store, self._board = store, board
        self._period, self._fallback = period_s, fallback_s
        self._asked = float("-inf")  # monotonic time of the last store check

    def seen(self, g: int, *, shutdown: bool = False) -> Look:
        """OUT, WAIT, or (with ``shutdown``) ENDED once the job is over; never ASK."""
        told, ended = self._board.told()
        now = time.monotonic()
        what = look(g, told, ended and shutdown, time.time() - self._board.relayed(), now - self._asked,
                    period_s=self._period, fallback_s=self._fallback)
        if what is not Look.ASK:
            return what
        self._asked = now
        if self._store.check([StoreKey.PLAN.of(g)]):
            return Look.OUT
        if shutdown and self._store.check([StoreKey.SHUTDOWN.value]):
            return Look.ENDED
        return Look.WAIT

    def out(self, g: int) -> bool:
        """Plan ``g`` is published."""
        return self.seen(g) is Look.OUT

    def text(self, g: int) -> str | bytes:
        """Published plan ``g``: the node's copy (its pulse kept it), else the store's."""
        directory = getattr(self._board, "directory", None)
        if directory is not None:
            try:
                with open(plan_path(directory, g), "rb") as f:
                    return f.read()
            except OSError:
                pass  # not sent to this node, not kept, or already replaced by newer ones
        return self._store.get(StoreKey.PLAN.of(g))
