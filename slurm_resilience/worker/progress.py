"""The rank's progress, in a page of shared memory its pulse process reads.

The main thread bumps a counter at every completed step and phase (a join, a
restore) and marks the bounded waits on its peers or on the supervisor's plan; a
write is a ``struct.pack_into`` into an mmap'ed page, no system call and no store
round trip. The pulse process (``pulse.py``) reads the page and reports it to the
supervisor, whose watchdog (``supervisor/progress.py``) tells a rank that stopped
making progress (hung) from one whose heartbeat thread is merely starved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import subprocess
import sys
import tempfile
from typing import Iterator

from .pulse import BUSY, COMPUTING, LAYOUT, PAGE, WAITING, read_board

log = logging.getLogger(__name__)

PULSE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pulse.py")


class ProgressBoard:
    """One page: progress counter, phase (computing, waiting, busy), liveness port, completed steps.

    Only the main thread writes ``progress``/``waiting``/``step``; the heartbeat thread
    writes ``port`` (after a supervisor restart). Each field is one aligned store.
    """

    def __init__(self, port: int) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._file = tempfile.TemporaryFile(dir=shm)  # unlinked at once; 0600
        self._file.truncate(PAGE)
        self.fd = self._file.fileno()
        self._page = mmap.mmap(self.fd, PAGE)
        LAYOUT.pack_into(self._page, 0, 0, 0, port, 0)
        self._progress = 0
        self._phases: list[int] = []  # nested phases; the page shows the innermost

    def bump(self, step: int | None = None) -> None:
        """The main thread moved on (a step completed, a phase began or ended)."""
        self._progress += 1
        self._page[0:8] = self._progress.to_bytes(8, "little")
        if step is not None:
            self._page[16:24] = int(step).to_bytes(8, "little")

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """The main thread waits on its peers (a collective, a join) or on a plan: a stall
        inside is not this rank's fault."""
        return self._phase(WAITING)

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """The main thread is in the toolkit's own checkpoint I/O (a restore from the tiers,
        a final or preemption save): no step timeout applies, it is not a step."""
        return self._phase(BUSY)

    @contextlib.contextmanager
    def _phase(self, code: int) -> Iterator[None]:
        self._phases.append(code)
        self._page[8:12] = code.to_bytes(4, "little")
        self.bump()
        try:
            yield
        finally:
            self._phases.pop()
            self._page[8:12] = (self._phases[-1] if self._phases else COMPUTING).to_bytes(4, "little")
            self.bump()

    def set_port(self, port: int) -> None:
        self._page[12:16] = int(port).to_bytes(4, "little")

    def read(self) -> tuple[int, int, int, int]:
        """(progress, waiting, port, step)."""
        return read_board(self._page)

    def close(self) -> None:
        self._page.close()
        self._file.close()


def start_pulse(board: ProgressBoard, *, host: str, period_s: float, hello: dict) -> subprocess.Popen | None:
    """Start the pulse process for this rank (None, logged, when it cannot start: the
    supervisor then falls back on the store heartbeats alone)."""
    cfg = {"pid": os.getpid(), "fd": board.fd, "host": host, "period": period_s, "hello": dict(hello, pulse=True)}
    try:
        proc = subprocess.Popen([sys.executable, "-I", PULSE_SCRIPT], stdin=subprocess.PIPE, pass_fds=(board.fd,),
                                stdout=subprocess.DEVNULL, close_fds=True)
        proc.stdin.write((json.dumps(cfg) + "\n").encode())  # the token: a pipe, not argv
        proc.stdin.close()
        return proc
    except OSError as exc:
        log.warning("pulse process not started (%s): liveness falls back on store heartbeats", exc)
        return None


def stop_pulse(proc: subprocess.Popen | None) -> None:
    """End this rank's pulse (it also exits by itself when the rank does)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=2)
