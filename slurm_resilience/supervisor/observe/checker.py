"""Carry out ``CheckSpare``: the spare health check (``slurm_resilience.health``) as a
short step on the spare node, in a background thread so that no check ever holds up
the loop or a recovery. Each result is queued as a ``SpareChecked`` observation.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

from ..decide.messages import SpareChecked

__all__ = ["SpareChecker"]


class SpareChecker:
    """Runs spare health checks in background threads; ``drain`` returns their results."""

    def __init__(self, run: Callable[[str, Sequence[str], float], tuple[int | None, str]],
                 argv: Callable[[str], list[str]], timeout_s: float) -> None:
        """``run``: the launcher's ``run_check``; ``argv``: the check's argv for a node."""
        self._run, self._argv, self._timeout = run, argv, timeout_s
        self.results: "queue.Queue[SpareChecked]" = queue.Queue()

    def start(self, node: str) -> None:
        """Start the check of ``node`` in a thread of its own (never raises: a failure is a result)."""
        def work() -> None:
            t0 = time.time()
            try:
                code, out = self._run(node, self._argv(node), self._timeout + 15.0)  # + the step's start
                reason = None if code == 0 else _reason(code, out)
            except Exception as exc:  # a check that cannot run is a failed check, never a crash
                reason = f"the health check could not run: {exc}"
            self.results.put(SpareChecked(node, reason, time.time(), time.time() - t0))

        threading.Thread(target=work, name=f"sr-check-{node}", daemon=True).start()

    def drain(self) -> list[SpareChecked]:
        """The checks finished since the last call (never blocks)."""
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out


def _reason(code: int | None, output: str) -> str:
    """Why a check failed: its output's last line, else the time-out or exit code."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    last = lines[-1][:300] if lines else ""
    if code is None:
        return last or "the health check timed out"
    return last or f"the health check exited {code}"
