"""A process holding many simulated ranks (``ranks.py``), driven by ``threads`` drivers.

Usage (by ``scale.py``): ``python -m scale_sim.rank_host SPEC_JSON``; prints its
control port. Two peers connect: the supervisor's ``SimLauncher`` (launch, kill; this
host reports exits back) and the orchestrator (fault injection, ``stats``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from .common import HOST, Channel, listen, raise_fd_limit
from .ranks import Driver, connect


class RankHost:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.launcher: Channel | None = None
        self._lock = threading.Lock()
        self.times: dict[str, dict[int, list]] = {"read": {}, "join": {}, "told": {}}  # kind → gen → [count, first, last]
        self._pace, self._next_start = threading.Lock(), 0.0
        self._starters = ThreadPoolExecutor(8, thread_name_prefix="sim-start")  # connects block
        self.drivers = [Driver(i, self._open_store, spec, self._record, self._exited) for i in range(spec["threads"])]
        for d in self.drivers:
            d.start()

    def _open_store(self):
        import torch.distributed as dist

        return dist.TCPStore(HOST, self.spec["store_port"], None, False, timedelta(seconds=300),
                             wait_for_workers=False)

    def _record(self, kind: str, gen: int, t: float) -> None:
        with self._lock:
            c = self.times[kind].setdefault(gen, [0, t, t])
            c[0] += 1
            c[1], c[2] = min(c[1], t), max(c[2], t)

    def _exited(self, worker_id: str, code: int) -> None:
        if self.launcher is not None:
            self.launcher.send(("exit", worker_id, code))

    def _start(self, environ: dict) -> None:
        wid = environ["SR_WORKER_ID"]
        with self._pace:  # real ranks start over seconds (srun, import torch), not in one burst
            wait = self._next_start - time.monotonic()
            self._next_start = max(self._next_start, time.monotonic()) + 1.0 / self.spec["start_rate"]
        if wait > 0:
            time.sleep(wait)
        try:
            r = connect(environ, self.spec["pulse"])
        except OSError as exc:  # a worker that cannot reach the supervisor dies at its start
            print(f"simulated rank {wid} failed to start: {exc}", file=sys.stderr, flush=True)
            self._exited(wid, 1)
            return
        self._driver(wid).inbox.put(("adopt", r))

    def _driver(self, worker_id: str) -> Driver:
        """By node (worker ids are ``{node}.{n}``): a node's ranks share one driver and so one
        node pulse connection, as they share one pulse process."""
        return self.drivers[zlib.crc32(worker_id.rsplit(".", 1)[0].encode()) % len(self.drivers)]

    def handle(self, ch: Channel, msg: tuple):
        what = msg[0]
        if what == "hello":
            self.launcher = ch
        elif what == "launch":
            self._starters.submit(self._start, msg[1])
        elif what == "kill":
            self._driver(msg[1]).inbox.put(msg)
        elif what in ("kill_node", "silence_node", "block", "finish", "stop"):
            for d in self.drivers:
                d.inbox.put(msg)
            return "ok"
        elif what == "stats":
            return self.stats()
        return None

    def stats(self) -> dict:
        phases: dict[str, int] = {}
        for d in self.drivers:
            for r in list(d.ranks.values()):
                phases[r.phase.value] = phases.get(r.phase.value, 0) + 1
        with self._lock:
            times = {k: {g: list(v) for g, v in per.items()} for k, per in self.times.items()}
        out = {"phases": phases, "times": times, "store_calls": sum(d.calls() for d in self.drivers),
               "lag_max_s": max(d.lag_max for d in self.drivers),
               "poll_lag_max_s": max(d.poll_lag_max for d in self.drivers), "late": sum(d.late for d in self.drivers),
               "pulse_drops": sum(d.pulse_drops for d in self.drivers),
               "closed_at": {n: t for d in self.drivers for n, t in d.closed_at.items()}, "now": time.time()}
        for d in self.drivers:
            d.lag_max = d.poll_lag_max = 0.0  # the window's maxima: reset at each look
        return out


def serve(host: RankHost, ch: Channel) -> None:
    while True:
        try:
            msg = ch.recv()
        except (EOFError, OSError):
            return
        reply = host.handle(ch, msg)
        if reply is not None:
            ch.send(reply)


def main() -> int:
    raise_fd_limit()
    spec = json.loads(sys.argv[1])
    listener = listen()
    host = RankHost(spec)
    print(listener.address[1], flush=True)
    for _ in range(2):  # the launcher, the orchestrator
        ch = Channel(listener.accept())
        threading.Thread(target=serve, args=(host, ch), daemon=True).start()
    sys.stdin.read()  # the orchestrator closes it (or dies)
    for d in host.drivers:
        d.stopping = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
