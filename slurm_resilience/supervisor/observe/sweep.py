"""Delete the store keys the watch has read, off the supervisor's loop.

Every event a worker writes is one store key (``event/{n}``) that the watch reads in
one batch and then removes. TCPStore has no multi-key delete, so the removal is one
round trip per event: 3 N events per generation (``reconnected``, ``restored``,
``first_step``), ~12,000 round trips at 4,096 ranks, which on the loop held the next
observation (and so the recovery's end) for seconds (docs/scale.md). The sweeper
does them in a thread of its own, through a store client of its own, so the loop's
requests never queue behind them.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Iterable

__all__ = ["Sweeper"]

log = logging.getLogger(__name__)


class Sweeper:
    """Removes keys in the background; ``put`` never blocks.

    Args:
        open_store: makes the sweeper's own store client (called once, in its thread,
            which starts with the first ``put``: the job's store listens by then).
    """

    def __init__(self, open_store: Callable[[], Any]) -> None:
        self._open = open_store
        self._keys: "queue.Queue[str | None]" = queue.Queue()
        self._thread: threading.Thread | None = None

    def put(self, keys: Iterable[str]) -> None:
        """Queue ``keys`` for removal (starts the thread the first time)."""
        for key in keys:
            self._keys.put(key)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sr-sweeper", daemon=True)
            self._thread.start()

    def pending(self) -> int:
        """Keys not removed yet (approximate)."""
        return self._keys.qsize()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop after the keys already queued (at most ``timeout_s``)."""
        if self._thread is not None:
            self._keys.put(None)
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            store = self._open()
        except Exception as exc:  # no client: the keys stay (a few bytes each); the job goes on
            log.warning("store sweeper not started: %s", exc)
            return
        while (key := self._keys.get()) is not None:
            try:
                store.delete_key(key)
            except Exception as exc:  # the store is gone: the job is ending
                log.debug("sweeper stops: %s", exc)
                return
