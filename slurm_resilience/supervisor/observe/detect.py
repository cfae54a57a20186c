"""Detect: turn signs of life (or their absence) into observations.

Four sources, fastest first:
* the liveness socket — a worker's TCP connection closes the moment its process
  dies (the kernel closes it), so a killed rank is seen within milliseconds;
* the pulse — one small process per node (``worker/pulse.py``) sends, in one line a
  period, each of the node's ranks' process state and progress counter over a
  liveness connection of its own, whatever the ranks' interpreters are doing (the
  watchdog, ``progress.py``, weighs it): N/G connections and lines, not N;
* the job step — ``srun`` returns when the step's task ends;
* heartbeats in the store — stale after ``heartbeat_timeout_s``: hung processes and
  nodes that vanish without closing anything (read by ``heartbeats.py``).
Slurm's own node state is polled off the critical path (see :class:`NodeWatcher`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hmac
import json
import logging
import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from ...worker.notices import KEEP_PLANS, crc, plan_delta
from .pulse_line import Pulse, pulse_entry

__all__ = ["SightingKind", "Sighting", "Pulse", "LivenessServer", "NodeWatcher"]

log = logging.getLogger(__name__)

TELL_BUFFER = 4 << 20  # send buffer of a pulse's connection: a plan (74 KB at 16,384 ranks) fits whole


class SightingKind(str, enum.Enum):
    """What the liveness server or the node watcher saw (a str enum: its values are the old strings)."""

    CONNECTED = "connected"  # a worker's liveness connection came up
    CLOSED = "closed"  # it closed, or the node's pulse reported the process gone
    NODE_STATE = "node_state"  # the resource manager says the node is unhealthy
    PULSE_CLOSED = "pulse_closed"  # the node's pulse connection closed (not one its pulse replaced)


@dataclasses.dataclass(frozen=True)
class Sighting:
    """Something the supervisor saw about one worker or node, before ``watch`` turns it
    into an observation for ``decide`` (``decide/messages.py``)."""

    kind: SightingKind
    worker_id: str | None
    node: str
    time: float
    pid: int | None = None
    detail: str = ""


# With this many node pulses (N/G lines every heartbeat period), a wake that found fewer
# than COALESCE_BATCH ready lines, and no connection arriving or saying hello, is followed
# by a COALESCE_S pause: at 1,024 pulses, one wake (and GIL hand-over from the loop) per
# line cost more than the lines' parsing (docs/scale.md). A death is then seen up to
# COALESCE_S later; smaller jobs never pause.
COALESCE_FROM, COALESCE_BATCH, COALESCE_S = 128, 16, 0.005


class LivenessServer:
    """Accepts token-checked connections: one per worker, which reports when it closes,
    and one per node's pulse process, whose newest line about each rank is kept
    (:meth:`pulses`)."""

    def __init__(self, host: str, token: str, out: "queue.Queue[Sighting]") -> None:
        self._token = token.encode()
        self._out = out
        self._sel = selectors.DefaultSelector()
        self._listener = socket.create_server((host, 0), backlog=256)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sr-liveness", daemon=True)
        self._lock = threading.Lock()
        self._pulses: dict[str, Pulse] = {}
        self._heard: dict[str, float] = {}  # node -> when its pulse's newest line came
        self._endpoints: dict[str, tuple[str, int]] = {}  # node -> its pulse's peer-probe endpoint
        self._reach: dict[str, dict[int, dict]] = {}  # node -> request id -> its pulse's answer (newest 4)
        self._conns: dict[str, socket.socket] = {}  # node -> its pulse's connection (for requests)
        self.rejected = 0
        # Notices to the pulses go out from this thread, which owns their sockets: sent from
        # the supervisor's loop, each of N/G sends gave the GIL to this busy thread (docs/scale.md).
        self._outbox: collections.deque[tuple[dict, list[str] | None]] = collections.deque()
        self._plans: dict[int, list] = {}  # generation -> [text, parsed or None]: a delta's base
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.tell_failed = 0  # notices a pulse's connection could not take whole
        self.pauses = 0  # COALESCE_S pauses taken

    def start(self) -> "LivenessServer":
        """Start the accepting and reading thread; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (waits up to 2 s for it) and close the listening socket."""
        self._stop.set()
        self._thread.join(timeout=2)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, busy = self._sel.select(timeout=0.05), False
            for key, _ in ready:
                if key.data is None:
                    self._accept()
                    busy = True  # connections arriving (a start, a restart): no pause
                elif key.data == "wake":
                    self._send_notices()
                else:
                    busy = busy or key.data["who"] is None  # a hello: a connection arriving
                    self._read(key)
            if not busy and len(self._conns) >= COALESCE_FROM and len(ready) < COALESCE_BATCH:
                self.pauses += 1
                time.sleep(COALESCE_S)  # let more lines arrive: one wake (and GIL hand-over) for many

    def _accept(self) -> None:
        """Every connection waiting in the backlog (a job's start brings thousands at once)."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            self._sel.register(conn, selectors.EVENT_READ, {"buf": b"", "who": None})

    def _read(self, key: selectors.SelectorKey) -> None:
        conn, state = key.fileobj, key.data
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return  # spurious wake-up: nothing to read yet
        except ConnectionResetError:
            data = b""
        if not data:
            self._sel.unregister(conn)
            conn.close()
            if state["who"] is not None and not state.get("pulse"):
                wid, node, pid = state["who"]
                self._out.put(Sighting(SightingKind.CLOSED, wid, node, time.time(), pid))
            elif state.get("pulse") and self._forget_pulse(state["who"][1], conn):
                # A pulse's end is not its ranks', but a small process dies in a millisecond
                # where a rank's teardown takes tens: the watch asks the node's slurmd at once.
                self._out.put(Sighting(SightingKind.PULSE_CLOSED, None, state["who"][1], time.time()))
            return
        if state["who"] is not None and not state.get("pulse"):
            return  # nothing is expected from a rank after the hello
        state["buf"] += data
        if state["who"] is not None:
            self._pulse_lines(state, conn)
            return
        if b"\n" not in state["buf"]:
            if len(state["buf"]) > 4096:
                self._reject(conn, "oversized hello")
            return
        line, state["buf"] = state["buf"].split(b"\n", 1)
        try:
            hello = json.loads(line)
            ok = hmac.compare_digest(str(hello["token"]).encode(), self._token)
            who = (str(hello["worker_id"]), str(hello["node"]), int(hello["pid"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            self._reject(conn, "bad token or malformed hello")
            return
        state["who"] = who
        if hello.get("agent"):  # the node's pulse process (worker/pulse.py): lines follow
            state["pulse"] = True
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TELL_BUFFER)  # a plan goes out in one send
            with self._lock:
                self._conns[who[1]] = conn
            self._pulse_lines(state, conn)
            return
        self._out.put(Sighting(SightingKind.CONNECTED, state["who"][0], state["who"][1],
                                  time.time(), state["who"][2]))

    def _pulse_lines(self, state: dict, conn: socket.socket) -> None:
        """Keep the newest word on each rank of the node; a rank said gone is a close.
        Only the newest complete line counts for the progress (older ones are superseded),
        but every line's ``gone`` does."""
        *lines, state["buf"] = state["buf"].split(b"\n")
        if len(state["buf"]) > 1 << 20:
            state["buf"] = b""  # never a line this long: drop it
        node = state["who"][1]
        now = time.time()
        fresh: dict[str, Pulse] = {}
        endpoint = reach = None
        for line in lines:
            try:
                msg = json.loads(line)
                for wid, pid in dict(msg.get("gone") or {}).items():
                    fresh.pop(str(wid), None)
                    self._out.put(Sighting(SightingKind.CLOSED, str(wid), node, now, int(pid), detail="pulse: process gone"))
                if msg.get("probe"):
                    endpoint = (str(msg["probe"][0]), int(msg["probe"][1]))
                if msg.get("reach"):
                    r = msg["reach"]
                    reach = (int(r["id"]), {"ok": set(map(str, r["ok"])), "bad": set(map(str, r["bad"]))})
                if self._conns.get(node) is not conn:
                    continue  # resent late on a link its pulse has replaced (pulse_link.py): superseded
                for wid, entry in dict(msg["ranks"]).items():
                    fresh[str(wid)] = pulse_entry(now, entry)
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn or foreign line: the next one will do
        with self._lock:
            if lines:
                self._heard[node] = now
            if fresh:
                self._pulses.update(fresh)
            if endpoint is not None:
                self._endpoints[node] = endpoint
            if reach is not None:
                answers = self._reach.setdefault(node, {})
                answers[reach[0]] = reach[1]
                for old in sorted(answers)[:-4]:
                    del answers[old]

    def _forget_pulse(self, node: str, conn: socket.socket) -> bool:
        """Drop the node's pulse connection if ``conn`` is it (True); a link its pulse has
        already replaced (``pulse_link.py``) is no news (False)."""
        with self._lock:
            if self._conns.get(node) is not conn:
                return False
            del self._conns[node]
            return True

    def heard(self) -> dict[str, float]:
        """When each node's pulse last sent a line (a snapshot, one entry per node)."""
        with self._lock:
            return dict(self._heard)

    def endpoints(self) -> dict[str, tuple[str, int]]:
        """Each node pulse's peer-probe endpoint (``worker/peer_probe.py``), a snapshot."""
        with self._lock:
            return dict(self._endpoints)

    def reach(self) -> dict[str, dict[int, dict]]:
        """Each node pulse's newest peer-probe answers: ``{node: {request id: {"ok", "bad"}}}``."""
        with self._lock:
            return {n: dict(a) for n, a in self._reach.items()}

    def ask_probes(self, requests: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Send each node's pulse its probe request; returns the nodes it could not be sent to."""
        with self._lock:
            conns = {n: self._conns.get(n) for n in requests}
        failed = []
        for node, req in requests.items():
            try:
                conns[node].sendall((json.dumps({"probe": req}) + "\n").encode())
            except (AttributeError, OSError):  # no pulse connection, or a full or closed one
                failed.append(node)
        return failed

    def tell(self, notice: Mapping[str, Any], nodes: Iterable[str] | None = None) -> None:
        """Send the pulses of ``nodes`` (default: every node) ``notice`` (``{"plan": g,
        "body": ...}``, ``{"shutdown": 1}``: worker/pulse.py writes them where its ranks
        look, worker/plan_watch.py). Returns at once; this server's thread sends it. A
        connection that cannot take it whole is closed (a line cut short would garble the
        next one; ``tell_failed`` counts them): its pulse reconnects, and its ranks ask the
        store meanwhile.

        A plan goes whole to a connection that has not taken the previous plan whole, and
        as a delta from it to the others (``worker/notices.py``): a node replaced in a plan
        of 16,384 ranks is a few hundred bytes per node instead of ~100 KB."""
        self._outbox.append((dict(notice), None if nodes is None else list(dict.fromkeys(nodes))))
        try:
            self._wake_w.send(b"\0")
        except OSError:  # already woken (a full pipe) or closed
            pass

    def _send_notices(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._outbox:
            notice, nodes = self._outbox.popleft()
            line, g, base, delta = _encode(notice), None, None, None
            if isinstance(notice.get("body"), str) and "plan" in notice:
                g, base, delta = self._plan_lines(int(notice["plan"]), notice["body"])
            with self._lock:
                conns = list(self._conns.values()) if nodes is None else [self._conns.get(n) for n in nodes]
            for conn in conns:
                if conn is None:
                    continue
                try:
                    state = self._sel.get_key(conn).data
                except (KeyError, ValueError):  # closed meanwhile
                    continue
                out = delta if delta is not None and state.get("plan") == base else line
                try:
                    if conn.send(out) == len(out):  # non-blocking: the send buffer takes it whole, or not
                        if g is not None:
                            state["plan"] = g
                        continue
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:  # a full (frozen node) or closed connection
                    pass
                self.tell_failed += 1

    def _plan_lines(self, g: int, text: str) -> tuple[int, int | None, bytes | None]:
        """(g, the base generation, the delta line from it; None, None: no base kept)."""
        self._plans[g] = [text, None]
        for old in [k for k in self._plans if k <= g - KEEP_PLANS]:
            del self._plans[old]
        base = max((k for k in self._plans if k < g), default=None)
        if base is None:
            return g, None, None
        docs = []
        for k in (base, g):
            if self._plans[k][1] is None:
                self._plans[k][1] = json.loads(self._plans[k][0])
            docs.append(self._plans[k][1])
        return g, base, _encode({"plan": g, "base": base, "delta": plan_delta(*docs), "crc": crc(text)})

    def pulses(self) -> dict[str, "Pulse"]:
        """The newest pulse of each worker (a snapshot)."""
        with self._lock:
            return dict(self._pulses)

    def _reject(self, conn: socket.socket, why: str) -> None:
        self.rejected += 1
        log.warning("liveness: rejected a connection (%s)", why)
        self._sel.unregister(conn)
        conn.close()


def _encode(notice: Mapping[str, Any]) -> bytes:
    return (json.dumps(dict(notice), separators=(",", ":")) + "\n").encode()


class NodeWatcher:
    """Polls the resource manager's node states in a thread; reports unhealthy ones."""

    def __init__(self, states: Callable[[Sequence[str]], dict[str, str]],
                 nodes: Callable[[], Iterable[str]], period_s: float,
                 out: "queue.Queue[Sighting]", unhealthy: Callable[[str], bool]) -> None:
        self._states, self._nodes, self._period = states, nodes, period_s
        self._out, self._unhealthy = out, unhealthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sr-nodewatch", daemon=True)

    def start(self) -> "NodeWatcher":
        """Start the polling thread; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the polling thread (waits up to 5 s for it)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            nodes = list(self._nodes())
            try:
                states = self._states(nodes)
            except Exception as exc:  # a slow or failing scontrol must not kill detection
                log.warning("node state poll failed: %s", exc)
                continue
            for node, state in states.items():
                if self._unhealthy(state):
                    self._out.put(Sighting(SightingKind.NODE_STATE, None, node, time.time(), detail=state))
