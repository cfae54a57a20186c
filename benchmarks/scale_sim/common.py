"""What the harness's processes share: the control channel, counted store calls, limits."""

from __future__ import annotations

import itertools
import resource
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

AUTHKEY = b"sr-scale-sim"  # the harness's own processes, loopback only
HOST = "127.0.0.1"


def raise_fd_limit() -> int:
    """Soft open-file limit up to the hard one (every simulated rank holds sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def listen() -> Listener:
    return Listener((HOST, 0), authkey=AUTHKEY)


class Channel:
    """A control connection whose ``send`` may be called from several threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, port: int) -> "Channel":
        return cls(Client((HOST, port), authkey=AUTHKEY))

    def send(self, msg: Any) -> None:
        with self._lock:
            self.conn.send(msg)

    def recv(self) -> Any:
        return self.conn.recv()

    def ask(self, msg: Any) -> Any:
        """Send and wait for the answer (one caller at a time per channel)."""
        with self._lock:
            self.conn.send(msg)
            return self.conn.recv()

    def close(self) -> None:
        self.conn.close()


class CountingStore:
    """Forwards every call to a store and counts it: one call is one round trip
    (``multi_get`` of many keys included), which is what the store serves."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._calls = itertools.count()  # next() is atomic under the GIL
        self._read = 0
        self._lock = threading.Lock()

    def calls(self) -> int:
        """Calls so far (reading does not count one)."""
        with self._lock:
            n = next(self._calls) - self._read
            self._read += 1
            return n

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            next(self._calls)
            return attr(*args, **kwargs)

        return call
