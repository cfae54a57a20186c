"""The rank's progress, in a page of shared memory its pulse process reads.

The main thread bumps a counter at every completed step and phase (a join, a
restore) and marks the bounded waits on its peers or on the supervisor's plan; a
write is a ``struct.pack_into`` into an mmap'ed page, no system call and no store
round trip. The node's pulse process (``pulse.py``, one per node for all its ranks)
reads the page and reports it to the supervisor, whose watchdog
(``supervisor/observe/watchdog.py``) tells a rank that stopped making progress (hung) from one
whose heartbeat thread is merely starved.

The page is ``{worker}.board`` in the node's pulse directory (:func:`pulse_dir`: node-local
shared memory, 0700, one per job and node); ``{worker}.rank`` announces the rank to the
pulse. :func:`ensure_pulse` starts the node's pulse when none runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import subprocess
import sys
import tempfile
from typing import Iterator

from .pulse import (BEAT, BEAT_AT, BOARD, BUSY, COMPUTING, LAYOUT, LOCK, PAGE, RANK, WAITING, read_board,
                    read_relayed, read_told, tidy)


__all__ = ["PULSE_SCRIPT", "pulse_dir", "ProgressBoard", "ensure_pulse", "tidy_if_unused", "stop_pulse"]


log = logging.getLogger(__name__)

PULSE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pulse.py")


def pulse_dir(token: str, node: str) -> str:
    """The node's pulse directory for this job: node-local shared memory (``/dev/shm``,
    else the temporary directory), named by a digest of the job's token (never the
    token) and the node, created 0700."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    digest = hashlib.sha256(token.encode()).hexdigest()[:16]
    path = os.path.join(base, f"sr-pulse-{digest}-{re.sub(r'[^A-Za-z0-9_.-]', '_', node)}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class ProgressBoard:
    """One page: progress counter, phase (computing, waiting, busy), liveness port, completed steps.

    Only the main thread writes ``progress``/``waiting``/``step``; the heartbeat thread
    writes ``port`` (after a supervisor restart). Each field is one aligned store.

    Args:
        port: the supervisor's liveness port, for the pulse to connect to.
        directory: the node's pulse directory (:func:`pulse_dir`); the page is then
            ``{worker_id}.board`` there and the rank is announced to the node's pulse.
            None: an anonymous page no pulse reads (tests, pulses off).
        worker_id: the rank's worker id (with ``directory``).
    """

    def __init__(self, port: int, directory: str | None = None, worker_id: str | None = None) -> None:
        self._paths: tuple[str, ...] = ()
        self.directory = directory
        if directory is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._file = tempfile.TemporaryFile(dir=shm)  # unlinked at once; 0600
        else:
            if not worker_id or "/" in worker_id or worker_id.startswith("."):
                raise ValueError(f"unusable worker id for a pulse board: {worker_id!r}")
            board = os.path.join(directory, worker_id + BOARD)
            fd = os.open(board, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._file = os.fdopen(fd, "r+b")
            self._paths = (os.path.join(directory, worker_id + RANK), board)
        self._file.truncate(PAGE)
        self.fd = self._file.fileno()
        self._page = mmap.mmap(self.fd, PAGE)
        LAYOUT.pack_into(self._page, 0, 0, 0, port, 0)
        BEAT.pack_into(self._page, BEAT_AT, 0.0, -1, -1, -1.0)
        self._progress = 0
        self._phases: list[int] = []  # nested phases; the page shows the innermost
        if self._paths:  # announce: written whole, then renamed (the pulse never reads half)
            tmp = self._paths[0] + ".tmp"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({"pid": os.getpid(), "worker_id": worker_id}, f)
            os.replace(tmp, self._paths[0])

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

    def beat(self, t: float, generation: int | None, rank: int | None, compute_ms: float | None) -> None:
        """The heartbeat thread's beat, for the node's pulse to fold into its line."""
        BEAT.pack_into(self._page, BEAT_AT, t, -1 if generation is None else int(generation),
                       -1 if rank is None else int(rank), -1.0 if compute_ms is None else float(compute_ms))

    def relayed(self) -> float:
        """When the node's pulse last sent this rank's entry to the supervisor (0: never)."""
        return read_relayed(self._page)

    def told(self) -> tuple[int, bool]:
        """What the supervisor told the node's pulse: (newest plan generation, -1: none; the job is over)."""
        return read_told(self._page)

    def read(self) -> tuple[int, int, int, int]:
        """(progress, waiting, port, step)."""
        return read_board(self._page)

    def leave(self) -> None:
        """The rank ends cleanly: its ``.rank`` file goes first (the node's pulse drops it
        silently, no "gone"), then its page's file; the page itself stays usable."""
        for path in self._paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._paths = ()

    def close(self) -> None:
        self.leave()
        self._page.close()
        self._file.close()


def ensure_pulse(directory: str, *, host: str, period_s: float, hello: dict) -> subprocess.Popen | None:
    """Start the node's pulse unless one runs (None then, or when it cannot start: the
    supervisor falls back on the store heartbeats). Exactly one per node: the pulse holds
    an exclusive ``flock`` on ``pulse.lock`` for its life (the lock is taken here and the
    locked file handed to it), so a rank that gets the lock knows none runs. Cheap
    enough to call at every heartbeat: a pulse killed with another rank's job step is
    back within a period."""
    fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # the node's pulse runs
        cfg = {"dir": directory, "host": host, "period": period_s, "hello": dict(hello, agent=True)}
        proc = subprocess.Popen([sys.executable, "-I", PULSE_SCRIPT], stdin=subprocess.PIPE, pass_fds=(fd,),
                                stdout=subprocess.DEVNULL, close_fds=True)
        proc.stdin.write((json.dumps(cfg) + "\n").encode())  # the token: a pipe, not argv
        proc.stdin.close()
        return proc
    except OSError as exc:
        log.warning("node pulse not started (%s): liveness falls back on store heartbeats", exc)
        return None
    finally:
        os.close(fd)  # the pulse's inherited copy keeps the lock


def tidy_if_unused(directory: str) -> None:
    """After this rank left: remove the node's pulse directory if no pulse runs there
    (its lock is free) and no rank is announced (a pulse that died leaves it behind)."""
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        tidy(directory)
    except OSError:
        pass  # the node's pulse runs: it tidies when it ends
    finally:
        os.close(fd)


def stop_pulse(proc: subprocess.Popen | None) -> None:
    """Reap a pulse this rank started once it has exited (it outlives the rank while other
    ranks of the node remain, and exits by itself when none does)."""
    if proc is not None:
        proc.poll()
