"""Worker events to the supervisor, which is the event log's only writer.

An event is a numbered JSON record in the store (``ev/{n}``, n from the counter
``ev/count``); the supervisor reads, logs and deletes it. Every kind is a
:class:`~slurm_resilience.protocol.WorkerEvent`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from ..protocol import StoreKey, WorkerEvent


__all__ = ["EventSink"]


class EventSink:
    """Sends a rank's events through its own store client.

    Thread-safe: the checkpoint writer thread emits too, and numbering and writing an
    event must not interleave with another's. ``where`` returns the (generation, rank)
    the worker is in now, either None while it has none.
    """

    def __init__(self, store: dist.Store, *, worker_id: str, node: str,
                 where: Callable[[], tuple[int | None, int | None]]) -> None:
        self._store = store
        self._worker_id = worker_id
        self._node = node
        self._where = where
        self._lock = threading.Lock()

    def emit(self, kind: WorkerEvent | str, **fields: Any) -> None:
        """Send one event. ``kind`` may be the enum or its value (the checkpoint engine
        passes plain strings); an unknown kind raises ValueError."""
        event = WorkerEvent(kind)
        generation, rank = self._where()
        rec = dict(fields, kind=event.value, t=time.time(), worker_id=self._worker_id,
                   node=self._node, generation=generation, rank=rank)
        with self._lock:
            n = self._store.add(StoreKey.EVENT_COUNTER.value, 1)
            self._store.set(StoreKey.EVENT.of(n), json.dumps(rec))
