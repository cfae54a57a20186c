"""Isolate: take a bad node out of service, off the recovery's critical path.

The node is already excluded in the supervisor's state when this runs (``decide``
did that); telling Slurm (``scontrol update nodename=X state=DOWN reason=…``, and in a
hetjob releasing the node from the component first) may take seconds, so it runs in
a thread and reports ``isolated`` / ``isolate_failed`` when it ends. Both executors
use this one routine.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..protocol import EventKind


class Isolator:
    """Runs isolations in background threads; ``join`` waits for them (job end)."""

    def __init__(self, isolate: Callable[[str, str, str], None], emit: Callable[..., object]) -> None:
        self._isolate, self._emit = isolate, emit
        self._threads: list[threading.Thread] = []

    def start(self, node: str, state: str, reason: str) -> None:
        def work() -> None:
            t0 = time.time()
            try:
                self._isolate(node, state, reason)
                self._emit(EventKind.ISOLATED, node=node, state=state, reason=reason, start=t0, end=time.time())
            except Exception as exc:  # reported, never fatal: the node is excluded regardless
                self._emit(EventKind.ISOLATE_FAILED, node=node, error=str(exc), start=t0, end=time.time())

        t = threading.Thread(target=work, name=f"sr-isolate-{node}", daemon=True)
        t.start()
        self._threads.append(t)

    def join(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
