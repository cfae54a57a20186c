"""A driver's event thread: its simulated ranks' events sent as a real rank sends its own.

A real rank's event writes (two store round trips each, ``worker/event_sink.py``) hold up
no other rank; a driver that made them in line would read the plan for its next rank only
after the round trips of the ranks before it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from slurm_resilience.worker.event_sink import EventSink

from .common import CountingStore


class EventWriter(threading.Thread):
    """Sends a driver's ranks' events through ``EventSink`` (a store client of its own), in order."""

    def __init__(self, idx: int, open_store: Callable[[], Any]) -> None:
        super().__init__(name=f"sim-events-{idx}", daemon=True)
        self._open_store = open_store
        self.queue: "queue.SimpleQueue[tuple | None]" = queue.SimpleQueue()
        self._store: CountingStore | None = None

    def run(self) -> None:
        import torch.distributed as dist

        raw = self._open_store()
        while (item := self.queue.get()) is not None:
            token, worker_id, node, where, kind, fields = item
            if self._store is None:
                self._store = CountingStore(dist.PrefixStore(token + "/", raw))
            EventSink(self._store, worker_id=worker_id, node=node, where=lambda w=where: w).emit(kind, **fields)

    def calls(self) -> int:
        return 0 if self._store is None else self._store.calls()
