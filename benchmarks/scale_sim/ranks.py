"""Simulated ranks: many per thread, each speaking the real protocol, no compute.

One ``Driver`` thread owns a set of ranks and one store client (its calls counted)
and runs their timers from a heap. A rank:

* connects its liveness socket with the job's token (``heartbeat.connect_liveness``);
  with ``pulse``, its node has one pulse connection (``pulse_link.connect``, per node and
  driver, as the node's one pulse process has);
* every ``heartbeat_period_s`` writes ``hb/{worker}`` as ``Heartbeat._beat`` does; the
  node's pulse sends one line for all its ranks a period, as ``pulse.run`` does
  (``pulse._send``);
* waits for ``plan/{g}`` polling every ``poll_interval_ms`` (``Membership.await_plan``,
  the shutdown key too) — where the tree under test has plan notices, it looks at what
  its node's pulse was told first and asks the store only by ``plan_watch.look``'s rule
  (the node's pulse connection reads the supervisor's ``{"plan": g, "body": ...}`` with
  ``notices.messages`` and folds it with ``notices.Told``) — reads it (the node's copy
  from that notice, else the store's, as ``PlanWatch.text``), admits itself as
  ``membership.admit`` does
  (join / wait / fenced / stop), and on joining emits ``reconnected``, ``restored`` and
  ``first_step`` through ``EventSink`` — sent by the driver's event thread with a store
  client of its own (``EventWriter``): a real rank's event writes hold up no other rank,
  and a driver that made them in line would read the plan for its next rank only after
  the round trips of the ranks before it (two per event);
* trains: one "step" every ``step_s``, at whose safe point it checks ``plan/{g+1}``
  (``Membership.newer_plan``); blocked (a peer is gone: the orchestrator says so) it
  polls ``plan/{g+1}`` every ``poll_interval_ms`` as a bounded-wait collective does.

Not simulated: the process group (gloo's own rendezvous keys and full mesh), state
sync, checkpoints. Each driver's ranks share its store client (one TCP connection per
driver, not per rank): see docs/scale.md.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import json
import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable

from slurm_resilience.protocol import Plan, PlanAction, Role, StoreKey, WorkerEnv, WorkerEvent
from slurm_resilience.worker.heartbeat import connect_liveness
from slurm_resilience.worker import pulse as pulse_wire
try:
    from slurm_resilience.worker.pulse_link import connect as _link_connect

    def _pulse_connect(host: str, port: int, hello: dict):
        """The pulse's connection (``pulse_link.connect``), with the patience of a
        connect into a full accept backlog while thousands of ranks start."""
        return _link_connect(host, port, hello, timeout=2)
except ImportError:  # an older tree under test
    _pulse_connect = pulse_wire._connect

from .event_writer import EventWriter
from .common import CountingStore


class Phase(enum.Enum):
    """AWAIT: polls for plan ``want`` (start, a standby, fenced-or-join pending).
    RUNNING: in generation ``gen``, a safe point every step. BLOCKED: in a collective
    a lost peer never joins: polls for ``gen + 1``. SILENT: frozen (nothing sent,
    nothing closed). ENDED: its sockets are closed."""

    AWAIT = "await"
    RUNNING = "running"
    BLOCKED = "blocked"
    SILENT = "silent"
    ENDED = "ended"


def connect(environ: dict, pulse: bool) -> SimRank:
    """A launched rank's start: its environment (the job's token read from its file, as
    a worker does), its liveness connection and its pulse's. Blocking (a full accept
    backlog holds a connect): run by the rank host's starter threads, never a driver.
    Raises OSError when the supervisor cannot be reached."""
    r = SimRank(WorkerEnv.from_environ(environ))
    r.liveness = connect_liveness(r.env)
    r.pulsed = pulse
    if pulse and not NODE_PULSE:  # an older tree under test: one pulse process per rank
        hello = {"token": r.env.token, "worker_id": r.env.worker_id, "node": r.env.node, "pid": 0, "pulse": True}
        r.pulse = _pulse_connect(r.env.store_addr, r.env.liveness_port, hello)
    return r


# The tree under test (PYTHONPATH) has one pulse per node (worker/pulse.py ``fold``), or,
# before that, one per rank: the simulator speaks whichever its supervisor expects.
NODE_PULSE = hasattr(pulse_wire, "fold")
# ... and the node's line carries each rank's heartbeat (``pulse.BEAT``): the rank then
# writes its store heartbeat only every ``heartbeat.STORE_EVERY`` periods.
BEAT_FOLD = hasattr(pulse_wire, "BEAT")
if BEAT_FOLD:
    from slurm_resilience.worker.heartbeat import STORE_EVERY
# ... and the supervisor sends the pulses each plan (``worker/notices.py``, ``plan_watch.py``).
try:
    from slurm_resilience.worker import notices
    from slurm_resilience.worker.plan_watch import Look, look
    PLAN_NOTICES = True
except ImportError:
    PLAN_NOTICES = False
if not PLAN_NOTICES:  # an older tree: every look asks the store
    class Look(enum.Enum):
        OUT, ENDED, WAIT, ASK = "out", "ended", "wait", "ask"


class NodePulse:
    """The node's pulse process, seen from the supervisor: one connection, one line a
    period with every live rank of the node (``worker/pulse.py``)."""

    def __init__(self, env: WorkerEnv) -> None:
        hello = {"token": env.token, "worker_id": f"pulse@{env.node}", "node": env.node, "pid": 0, "agent": True}
        self.sock = _pulse_connect(env.store_addr, env.liveness_port, hello)
        self.ranks: list[SimRank] = []
        self.gone: dict[str, int] = {}
        self.last = 0.0
        self.told = notices.Told() if PLAN_NOTICES else None
        self.bodies: dict[int, str] = {}  # what the pulse keeps on file for its ranks (``Told(directory)``)
        self.inbox = b""

    def read(self, rebuilt: dict) -> bool:
        """The supervisor's notices that arrived (``pulse.run``'s read of its connection);
        False once it is closed. ``rebuilt``: the driver's plans rebuilt from a delta, by
        (generation, CRC): each node's pulse rebuilds it in its own process, the simulator
        once per driver (as it parses a plan once per driver for its ranks)."""
        got, self.inbox = notices.messages(self.sock, self.inbox)
        for msg in got or ():
            key = (msg.get("plan"), msg.get("crc"))
            if "delta" in msg and key in rebuilt and msg.get("base") == self.told.generation:
                msg = {"plan": msg["plan"], "body": rebuilt[key]}
            if self.told.take(msg):
                if "delta" in msg and self.told.body(self.told.generation) is not None:
                    rebuilt[key] = self.told.body(self.told.generation)
                body = self.told.body(self.told.generation) if hasattr(self.told, "body") else msg.get("body")
                self.bodies = {g: b for g, b in self.bodies.items() if g > self.told.generation - notices.KEEP_PLANS}
                if isinstance(body, str):  # an older tree's Told keeps no text: the message's
                    self.bodies[self.told.generation] = body
        return got is not None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None


class SimRank:
    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self.phase = Phase.AWAIT
        self.want = env.generation
        self.gen: int | None = None
        self.rank: int | None = None
        self.joined = False
        self.step = 0
        self.progress = 0
        self.version = 0  # bumped when its timers are replaced: stale heap entries are skipped
        self.liveness: socket.socket | None = None
        self.pulse: socket.socket | None = None  # its own pulse (an older tree under test)
        self.pulsed = False
        self.beat_t = 0.0  # its newest beat (folded into the node's pulse line)
        self.stored = 0.0  # its newest store heartbeat
        self.asked = float("-inf")  # when it last asked the store for a plan (monotonic)

    def close(self) -> None:
        for s in (self.liveness, self.pulse):
            if s is not None:
                s.close()
        self.liveness = self.pulse = None
        self.phase = Phase.ENDED


BEAT, CHECK = 0, 1


class Driver(threading.Thread):
    """Runs its ranks' timers. ``record(kind, gen, t)`` notes a plan read or a join;
    ``exited(worker_id, code)`` reports a rank's end to the launcher."""

    def __init__(self, idx: int, open_store: Callable[[], Any], cfg: dict,
                 record: Callable[[str, int, float], None], exited: Callable[[str, int], None]) -> None:
        super().__init__(name=f"sim-driver-{idx}", daemon=True)
        self.cfg = cfg
        self.period = cfg["heartbeat_period_s"]
        self.poll = cfg["poll_interval_ms"] / 1000.0
        self.step_s = cfg["step_s"]
        self._open_store, self.record, self.exited = open_store, record, exited
        self.inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.ranks: dict[str, SimRank] = {}
        self._raw: Any = None  # the driver's store client (heartbeat.open_store's TCPStore)
        self._prefix: CountingStore | None = None
        # Two timer heaps: a real rank's heartbeat is a thread of its own, so a driver busy
        # polling for plans must not starve the beats (those first; polls for a slice at most).
        self._heaps: tuple[list, list] = ([], [])
        self._seq = itertools.count()
        self._plans: dict[int, tuple[Plan, dict[str, Any]]] = {}  # parsed once per driver
        self._rebuilt: dict[tuple, str] = {}  # plans rebuilt from a delta, once per driver
        self.lag_max = 0.0  # the latest heartbeat (behind its schedule), seconds
        self.late = 0  # heartbeats sent later than one period behind schedule
        self.poll_lag_max = 0.0  # the latest plan poll or safe point, seconds
        self.pulse_drops = 0
        self.node_pulses: dict[str, NodePulse] = {}
        self._sel = selectors.DefaultSelector()  # the node pulses' connections (notices)
        self.closed_at: dict[str, float] = {}  # node → when its ranks' sockets were closed
        self.stopping = False
        self.events = EventWriter(idx, open_store)
        self.events.start()

    def _emit(self, r: SimRank, kind: WorkerEvent, **fields: Any) -> None:
        """``r``'s event, with its generation and rank as of now, to the event thread."""
        self.events.queue.put((r.env.token, r.env.worker_id, r.env.node, (r.gen, r.rank), kind, fields))

    # -- timers ---------------------------------------------------------------------------
    def _at(self, t: float, kind: int, r: SimRank) -> None:
        heapq.heappush(self._heaps[kind], (t, next(self._seq), r.version, r))

    def run(self) -> None:
        self._raw = self._open_store()
        while not self.stopping:
            self._inbox(64)  # a launch burst is taken a little at a time, between the timers
            self._notices()
            self._due(BEAT, None)
            self._due(CHECK, time.monotonic() + 0.01)
            nxt = min((h[0][0] for h in self._heaps if h), default=time.monotonic() + 0.05)
            wait = nxt - time.monotonic()
            if wait > 0:
                try:
                    self._handle(self.inbox.get(timeout=min(wait, 0.05)))
                except queue.Empty:
                    pass

    def _due(self, kind: int, until: float | None) -> None:
        """Run the due timers of ``kind`` (until the monotonic time ``until``, if given)."""
        heap = self._heaps[kind]
        now = time.monotonic()
        while heap and heap[0][0] <= now and (until is None or now < until):
            t, _, version, r = heapq.heappop(heap)
            if version != r.version or r.phase in (Phase.SILENT, Phase.ENDED):
                continue
            lag = now - t
            if kind == BEAT:
                self.lag_max = max(self.lag_max, lag)
                self.late += lag > self.period
                self._beat(r, t, now)
            else:
                self.poll_lag_max = max(self.poll_lag_max, lag)
                self._check(r, t, now)
            now = time.monotonic()

    def _notices(self) -> None:
        """Read the node pulses' connections that have something (one epoll wait: a rank
        host's descriptors go past select's 1,024)."""
        if not PLAN_NOTICES or not self._sel.get_map():
            return
        for key, _ in self._sel.select(timeout=0):
            before = key.data.told.generation
            if not key.data.read(self._rebuilt):  # the supervisor closed it
                self._sel.unregister(key.fileobj)
            if key.data.told.generation > before:  # the node's pulse has plan g (and its ranks, in their pages)
                self.record("told", key.data.told.generation, time.time())

    def _seen(self, r: SimRank, store, g: int, now: float, shutdown: bool = False) -> Look:
        """``PlanWatch.seen`` for a simulated rank: its node pulse's notices first, the store by the rule."""
        np_ = self.node_pulses.get(r.env.node) if r.pulsed else None
        if PLAN_NOTICES:
            told = np_.told if np_ is not None else notices.Told()
            relayed_age = now - np_.last if np_ is not None and np_.sock is not None else float("inf")
            what = look(g, told.generation, told.ended and shutdown, relayed_age, now - r.asked, period_s=self.period)
            if what is not Look.ASK:
                return what
            r.asked = now
        if store.check([StoreKey.PLAN.of(g)]):
            return Look.OUT
        if shutdown and store.check([StoreKey.SHUTDOWN.value]):
            return Look.ENDED
        return Look.WAIT

    def _forget(self, np_: NodePulse) -> None:
        try:
            self._sel.unregister(np_.sock)
        except (KeyError, ValueError):
            pass  # never registered, or already gone

    def _inbox(self, most: int) -> None:
        for _ in range(most):
            try:
                self._handle(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        what = msg[0]
        if what == "adopt":
            self._adopt(msg[1])
        elif what == "kill":
            r = self.ranks.get(msg[1])
            if r is not None and r.phase is not Phase.ENDED:
                r.close()
                np_ = self.node_pulses.get(r.env.node)
                if np_ is not None:
                    np_.gone[r.env.worker_id] = 0  # the node's pulse saw its pidfd turn readable
            if r is not None:
                self.exited(msg[1], -9)
        elif what in ("kill_node", "silence_node"):
            t = time.time()
            for r in self.ranks.values():
                if r.env.node == msg[1] and r.phase is not Phase.ENDED:
                    if what == "kill_node":
                        r.close()
                    else:
                        r.phase = Phase.SILENT
            if what == "kill_node" and msg[1] in self.node_pulses:
                self._forget(self.node_pulses[msg[1]])
                self.node_pulses[msg[1]].close()  # the node's pulse died with it
            self.closed_at[msg[1]] = t
        elif what == "block":
            now = time.monotonic()
            for r in self.ranks.values():
                if r.phase is Phase.RUNNING and r.gen == msg[1]:
                    r.phase, r.want, r.version = Phase.BLOCKED, r.gen + 1, r.version + 1
                    r.progress += 1
                    self._at(now, BEAT, r)
                    self._at(now, CHECK, r)
        elif what == "finish":
            for r in self.ranks.values():
                if r.phase in (Phase.RUNNING, Phase.BLOCKED):
                    self._prefixed(r.env).set(StoreKey.DONE.of(r.rank), str(r.step))
                    self._emit(r, WorkerEvent.DONE, step=r.step)
                    r.close()
                    self.exited(r.env.worker_id, 0)
        elif what == "stop":
            self.stopping = True
            self.events.queue.put(None)

    # -- one rank -------------------------------------------------------------------------
    def _adopt(self, r: SimRank) -> None:
        """A rank whose connections are open (``connect``) starts beating and polling here."""
        self.ranks[r.env.worker_id] = r
        if r.pulsed and NODE_PULSE:
            if r.env.node not in self.node_pulses:
                np_ = self.node_pulses[r.env.node] = NodePulse(r.env)
                if PLAN_NOTICES and np_.sock is not None:
                    self._sel.register(np_.sock, selectors.EVENT_READ, np_)
            self.node_pulses[r.env.node].ranks.append(r)
        now = time.monotonic()
        self._beat(r, now, now)  # Heartbeat.start beats once before its thread
        self._at(now, CHECK, r)

    def _prefixed(self, env: WorkerEnv):
        """The driver's client under the job's prefix (``heartbeat.open_store``'s PrefixStore)."""
        if self._prefix is None:
            import torch.distributed as dist

            self._prefix = CountingStore(dist.PrefixStore(env.token + "/", self._raw))
        return self._prefix

    def calls(self) -> int:
        """Store calls so far."""
        return (0 if self._prefix is None else self._prefix.calls()) + self.events.calls()

    def _beat(self, r: SimRank, due: float, now: float) -> None:
        waiting = 0 if r.phase is Phase.RUNNING else 1
        info = {"pid": 0, "generation": r.gen if r.gen is not None else r.env.generation, "rank": r.rank,
                "step": r.step}
        r.beat_t = t_now = time.time()
        np_ = self.node_pulses.get(r.env.node) if r.pulsed else None
        relayed = BEAT_FOLD and np_ is not None and np_.sock is not None
        if not relayed or t_now - r.stored >= STORE_EVERY * self.period:  # Heartbeat._beat
            self._prefixed(r.env).set(StoreKey.HEARTBEAT.of(r.env.worker_id),
                                      json.dumps(dict(info, progress=r.progress, phase=waiting, t=t_now)))
            r.stored = t_now
        if r.pulse is not None and not pulse_wire._send(r.pulse, {
                "progress": r.progress, "waiting": waiting, "step": r.step, "state": "S", "cpu": 0,
                "t": time.time()}):
            self.pulse_drops += 1
        if np_ is not None and np_.sock is not None and now - np_.last >= 0.9 * self.period:
            np_.last = now  # one line for the node's live ranks
            np_.ranks = [x for x in np_.ranks if x.phase is not Phase.ENDED]
            live = {x.env.worker_id: [0, x.progress, 0 if x.phase is Phase.RUNNING else 1, x.step, "S", 0]
                    + ([round(x.beat_t, 3), x.gen if x.gen is not None else x.env.generation,
                        -1 if x.rank is None else x.rank, -1.0] if BEAT_FOLD else [])
                    for x in np_.ranks if x.phase is not Phase.SILENT}
            if not pulse_wire._send(np_.sock, {"t": time.time(), "ranks": live, "gone": np_.gone}):
                self.pulse_drops += 1
            np_.gone = {}
        self._at(max(due + self.period, now), BEAT, r)

    def _check(self, r: SimRank, due: float, now: float) -> None:
        store = self._prefixed(r.env)
        if r.phase is Phase.RUNNING:  # a safe point: the step is done; a newer plan?
            r.step += 1
            r.progress += 1
            if self._seen(r, store, r.gen + 1, now) is not Look.OUT:
                self._at(max(due + self.step_s, now), CHECK, r)
                return
            r.want = r.gen + 1
        else:
            seen = self._seen(r, store, r.want, now, shutdown=r.phase is Phase.AWAIT)
            if seen is not Look.OUT:
                if seen is Look.ENDED:
                    r.close()
                    self.exited(r.env.worker_id, 0)
                    return
                self._at(max(due + self.poll, now), CHECK, r)
                return
        self._admit(r, store, r.want)

    def _admit(self, r: SimRank, store, g: int) -> None:
        np_ = self.node_pulses.get(r.env.node) if r.pulsed else None
        raw = np_.bodies.get(g) if np_ is not None and np_.told is not None else None
        if raw is None:  # PlanWatch.text: the node's copy, else the store's
            raw = store.get(StoreKey.PLAN.of(g))
        t_read = time.time()
        if g not in self._plans:
            plan = Plan.from_json(raw)
            self._plans[g] = (plan, {s.worker_id: s for s in plan.table.slots})
        plan, slots = self._plans[g]
        slot = slots.get(r.env.worker_id)  # membership.admit, with the slot found by a dict
        if plan.action in (PlanAction.ABORT, PlanAction.STOP):
            r.close()
            self.exited(r.env.worker_id, 3 if plan.action is PlanAction.ABORT else 0)
            return
        if slot is None:
            if r.env.role is Role.RANK or r.joined:
                self._emit(r, WorkerEvent.FENCED, generation=g)
                r.close()
                self.exited(r.env.worker_id, 0)
                return
            r.phase, r.want = Phase.AWAIT, g + 1  # a standby not chosen waits for the next plan
            self._at(time.monotonic() + self.poll, CHECK, r)
            return
        self.record("read", g, t_read)  # by a rank of the plan (standbys left waiting do not count)
        r.gen, r.rank, r.joined, r.phase = g, slot.rank, True, Phase.RUNNING
        r.version += 1
        r.progress += 1
        self._emit(r, WorkerEvent.RECONNECTED, start=time.time(), joining=slot.rank in plan.joining)
        self.record("join", g, time.time())
        self._emit(r, WorkerEvent.RESTORED, step=r.step)
        self._emit(r, WorkerEvent.FIRST_STEP, step=r.step)
        now = time.monotonic()
        self._at(now + self.period, BEAT, r)
        self._at(now + self.step_s, CHECK, r)

