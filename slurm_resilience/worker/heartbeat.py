"""The rank's signs of life: a liveness socket and store heartbeats.

The liveness socket is a TCP connection to the supervisor opened with the job's
token; when the process dies the kernel closes it, so a killed rank is seen in
milliseconds. Heartbeats (every ``period`` seconds, to the store, from a thread
with its own store client) catch what a socket cannot: a hung process or a node
that vanished without closing anything.

Both need this interpreter to be scheduled, and a thread needs the GIL: a rank
whose main thread holds it (a long pure-Python section, a GIL-holding extension
call) or a box with more busy processes than cores delays its beats. So the
heartbeat also makes sure the node's pulse process runs (``pulse.py``, one per node
for all its ranks), which reports the progress the main thread writes into shared
memory (``progress.py``) whatever this interpreter is doing; the supervisor's watchdog
weighs the three.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..protocol import StoreKey, WorkerEnv
from .progress_page import ProgressBoard, ensure_pulse, pulse_dir, stop_pulse, tidy_if_unused


__all__ = ["open_store", "connect_liveness", "STORE_EVERY", "Heartbeat"]


def open_store(env: WorkerEnv, timeout_s: float = 60.0) -> dist.Store:
    """A client of the supervisor's store, scoped to the job's secret prefix."""
    base = dist.TCPStore(
        env.store_addr, env.store_port, None, False, timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(env.token + "/", base)


def connect_liveness(env: WorkerEnv, port: int | None = None) -> socket.socket:
    """Connect to the supervisor's liveness socket and say who this worker is (token, id, node, pid)."""
    sock = socket.create_connection((env.store_addr, port or env.liveness_port), timeout=30)
    hello = {"token": env.token, "worker_id": env.worker_id, "node": env.node, "pid": os.getpid()}
    sock.sendall((json.dumps(hello) + "\n").encode())
    sock.settimeout(None)
    return sock


def _closed(sock: socket.socket) -> bool:
    """The peer closed the connection (the supervisor died); nothing is ever sent to us."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


STORE_EVERY = 2  # periods between store heartbeats while the node's pulse relays the beats


class Heartbeat:
    """Background heartbeats; ``update`` sets what the next beat reports.

    Each beat goes into the rank's page, where the node's pulse folds it into its one
    line for the node (``pulse.py``). The store heartbeat (``hb/{worker}``) is written
    every beat while no pulse relays them (pulses off, none running, or its line not
    sent for two periods), and only every ``STORE_EVERY`` periods while one does: the
    supervisor then takes the beat from the pulse line, and the store's N writes a
    period become N/``STORE_EVERY`` (docs/scale.md).

    It also keeps the liveness connection: when the supervisor dies and a restarted
    one publishes a new liveness port in the store, the connection is re-opened there.
    """

    def __init__(self, env: WorkerEnv, period_s: float, *, pulse: bool = True) -> None:
        self._env = env
        self._port = env.liveness_port
        self.liveness = connect_liveness(env)
        self._pulse = self._pulse_dir = None
        if pulse:
            for attempt in (1, 2):  # the node's last pulse may be removing the directory just now
                try:
                    self._pulse_dir = pulse_dir(env.token, env.node)
                    self.progress = ProgressBoard(env.liveness_port, self._pulse_dir, env.worker_id)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        else:
            self.progress = ProgressBoard(env.liveness_port)
        self._period = period_s
        self._ensure_pulse()
        self._store = open_store(env)
        self._info = {"pid": os.getpid(), "generation": env.generation, "rank": None, "step": 0}
        self._stored = 0.0  # when the last store heartbeat was written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sr-heartbeat", daemon=True)

    @property
    def period_s(self) -> float:
        """Seconds between two beats (the pulse's line period too)."""
        return self._period

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def update(self, **info) -> None:
        """Called by the main thread as it moves on: the progress counter advances too."""
        with self._lock:
            self._info.update(info)
        self.progress.bump(info.get("step"))

    def _beat(self) -> None:
        progress, phase, _, _ = self.progress.read()  # the pulse's page: a dead pulse loses nothing
        now = time.time()
        with self._lock:
            payload = dict(self._info, progress=progress, phase=phase, t=now)
        self.progress.beat(now, payload.get("generation"), payload.get("rank"), payload.get("compute_ms"))
        relayed = self._pulse_dir is not None and now - self.progress.relayed() <= 2 * self._period
        if relayed and now - self._stored < STORE_EVERY * self._period:
            return  # the node's pulse carries this beat
        self._store.set(StoreKey.HEARTBEAT.of(self._env.worker_id), json.dumps(payload))
        self._stored = now

    def _ensure_pulse(self) -> None:
        """The node's pulse runs (started here if no rank of the node has one running)."""
        if self._pulse_dir is None:
            return
        stop_pulse(self._pulse)  # reap ours if it ended
        hello = {"token": self._env.token, "worker_id": f"pulse@{self._env.node}", "node": self._env.node,
                 "pid": 0}
        started = ensure_pulse(self._pulse_dir, host=self._env.store_addr, period_s=self._period, hello=hello)
        if started is not None:
            self._pulse = started

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._ensure_pulse()
                self._beat()
                if _closed(self.liveness):
                    self._reconnect()
            except (RuntimeError, OSError):
                return  # the store is gone: the job is over

    def _reconnect(self) -> None:
        """A restarted supervisor listens on a new port (published in the store)."""
        port = int(self._store.get(StoreKey.LIVENESS_PORT.value))
        if port == self._port:
            return  # not restarted yet: try again at the next beat
        old, self.liveness, self._port = self.liveness, connect_liveness(self._env, port), port
        old.close()
        self.progress.set_port(port)  # the pulse process reconnects there

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.progress.leave()  # the node's pulse drops this rank (and exits once none is left)
        stop_pulse(self._pulse)
        if self._pulse_dir is not None:
            tidy_if_unused(self._pulse_dir)
        self.liveness.close()
