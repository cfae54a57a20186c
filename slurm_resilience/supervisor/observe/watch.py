"""Online executor, eyes: turn what the adapters show into observations for ``decide``.

Sources, each polled from the loop (none blocks longer than the 20 ms queue wait):
liveness sockets (a node pulse's close: its slurmd asked at once, then again: ``probe.PulseCloses``)
and the Slurm node-state thread (``detect.py``, through a queue), the workers' job steps,
heartbeats and pulses weighed by the watchdog (``progress.py``: hung → suspect, starved
→ reported; compute time → stragglers), the workers' events (logged; recovery marks),
done keys, the preemption request, and excluded nodes that may have come back.

Suspects of a silent node (every worker there heartbeat-stale, ``probe.silent_nodes``)
are held while a probe thread asks that node's slurmd a Slurm request (``probe.NodeProber``,
bounded by ``detect.slurmd_probe_deadline_s``), and, if it answered, while its peers say
whether they reach it (``partition.held_for_peers``); then they go to ``decide``, so the
loop never waits on the node. A verdict counts only if its probe started after the
node's newest sign of life (when probes start: ``silence.py``, ``probe.py``).
"""

from __future__ import annotations

import json
import logging
import queue
import time
from typing import Any, Callable, Mapping

from ...config import ResilienceConfig
from ...events import EventLog
from ...program_error import ProgramError
from ...protocol import EventKind, StoreKey, WorkerEvent
from ..decide.classify import node_unhealthy
from .detect import Sighting, SightingKind
from .heartbeats import present_keys, read_heartbeats, stale_workers
from ..adapters.launcher import Launcher, StepHandle
from .probe import NodeProbed, NodeProber, PulseCloses, silent_nodes
from .silence import silence
from . import partition
from ..decide.messages import (AllDone, Connected, LivenessChange, NodeBack, Observation, Preempted, Straggler,
                               Suspect, Suspects, Tick, WorkerMark, WorkerMarks)
from .watchdog import ACTED_ON, ProgressWatch, progress_in
from ..decide import standbys
from ..decide.recover import returning_candidates
from ..decide.state import SupervisorState
from .straggler import StragglerPolicy, StragglerWatch

__all__ = ["Watch", "SILENCE_LOOK_S", "EVENT_HOLE_S", "POLL_WORKERS"]

log = logging.getLogger(__name__)
SILENCE_LOOK_S = 0.05  # how often the node-silence look runs (O(nodes); silence.py)
EVENT_HOLE_S = 1.0  # an event counted but unwritten this long is skipped (its writer died)
POLL_WORKERS = 2048  # the O(N) look runs once a heartbeat period up to this many workers, pro rata less often above
_MARKS = frozenset({WorkerEvent.RECONNECTED, WorkerEvent.RESTORED, WorkerEvent.FIRST_STEP, WorkerEvent.DONE})
_KNOWN = frozenset(e.value for e in WorkerEvent)


class Watch:
    """Gathers observations; holds only detection bookkeeping (never decisions)."""

    def __init__(self, *, cfg: ResilienceConfig, store, seen: "queue.Queue[Sighting]", launcher: Launcher,
                 handles: Mapping[str, StepHandle], events: EventLog, preempted: Callable[[], bool],
                 events_seen: int = 0, pulses: Callable[[], Mapping[str, Any]] = dict,
                 sweep: Callable[[list[str]], None] | None = None,
                 heard: Callable[[], Mapping[str, float]] = dict, peers: partition.PeerLink | None = None) -> None:
        """``pulses``: the newest pulse per worker (``LivenessServer.pulses``); ``sweep``:
        removes read event keys off the loop (``sweep.Sweeper.put``; None: here, one by one);
        ``heard``: when each node's pulse last sent a line (``LivenessServer.heard``); ``peers``:
        the node pulses' peer probes (``LivenessServer``; None: no partition blame)."""
        self.sweep, self.heard = sweep, heard
        self._hb_heard: dict[str, float] = {}  # node -> its ranks' newest heartbeat (each poll)
        self._rank_nodes: tuple[object, dict[str, list[str]]] = (None, {})  # (table, node -> its ranks)
        self._ranks_of: tuple[object, dict[str, int]] = (None, {})  # (table, worker -> rank)
        self._live: tuple[tuple | None, list[str]] = (None, [])  # (what it was built from, live workers)
        self.cfg, self.store, self.seen, self.launcher, self.pulses = cfg, store, seen, launcher, pulses
        self.partition = None if peers is None else partition.PartitionWatch(peers, cfg.detect.peer_probe_s)
        d = cfg.detect
        # A pulse vouches for a stale heartbeat while it is at most 4 periods (>= 1 s) old: on a
        # frozen node both stop together, and the node must not be found later than before.
        self.progress = ProgressWatch(stale_s=d.heartbeat_timeout_s, soft_s=d.progress_soft_s,
                                      hard_s=d.progress_hard_s, factor=d.progress_factor,
                                      block_s=d.block_floor_s,
                                      pulse_s=min(d.heartbeat_timeout_s, max(4 * d.heartbeat_period_s, 1.0)))
        self.handles, self.events, self.preempted, self.events_seen = handles, events, preempted, events_seen
        self.steps: dict[str, int] = {}  # last step per worker (heartbeats), for the status
        self.connected_at: dict[str, float] = {}
        self.stragglers = StragglerWatch(StragglerPolicy(
            threshold=cfg.detect.straggler_threshold, window=cfg.detect.straggler_window))
        self._hole, self._late = None, {}  # (event number, since) not yet written; skipped holes (number → since)
        self._last_hb, self._last_return, self._last_silence, self._preempt_sent = 0.0, 0.0, 0.0, False
        self.prober = NodeProber(launcher.node_reachable, launcher.probe_slurmd, cfg.detect.slurmd_probe_deadline_s)
        self.closes = PulseCloses(lambda n: launcher.node_reachable(n, cfg.detect.probe_timeout_s))
        self._held: dict[str, dict[str, dict[str, Any]]] = {}  # silent node → its suspects, probe running
        self._verdicts: dict[str, NodeProbed] = {}  # newest probe result per node
        self._beats: dict[str, float] = {}  # newest heartbeat time per worker
        self._hb_keys: dict[str, str] = {}  # worker → its heartbeat key (built once)
        self._done_keys: tuple[object, list[str]] = (None, [])  # (table, its ranks' done keys)

    def observe(self, state: SupervisorState) -> list[Observation]:
        """One look at every source: the observations for ``decide``, a ``Tick`` last."""
        out: list[Observation] = []
        if not self._preempt_sent and (self.preempted() or self.store.check([StoreKey.PERSIST_REQUEST.value])):
            self._preempt_sent = True  # a rank got the signal (sent to the steps), or we did
            return [Preempted(self.cfg.job.preempt_signal_name)]
        suspects: dict[str, dict[str, Any]] = {}
        out += self._drain(state, suspects, 0.02)
        now = time.time()
        self.closes.look(now, state, suspects)  # a pulse's close that its node's slurmd outlived, asked again
        polled = now - self._last_hb >= self.cfg.detect.heartbeat_period_s * max(1.0, len(state.workers) / POLL_WORKERS)
        if polled:  # the O(N) sources, once a heartbeat period (a death is seen at once by its socket)
            self._last_hb = now
            for wid, h in self.handles.items():
                if h.exit_code() is not None and state.watched(wid):
                    suspects.setdefault(wid, {"t": now})["process_exited"] = True
            out += self._heartbeats(state, suspects, now)
            partition.look(self, state, suspects, now)
            out += self._drain(state, suspects, 0.0)  # a socket closed during the O(N) read
        if self.cfg.detect.silence_s and now - self._last_silence >= SILENCE_LOOK_S:
            self._last_silence = now
            silence(self, state, suspects, now)
        if suspects:
            self._hold_silent(state, suspects)
        probed = self._probed(state)
        if suspects or probed:
            out.append(self._probe(state, suspects, probed))
        marks = self.poll_events(state)
        out += marks
        # All done: one ``check`` of every rank's done key, at the heartbeat cadence or when
        # a rank has just said it is done (never a round trip per rank, nor one per loop turn).
        ended = any(m.kind is WorkerEvent.DONE for batch in marks for m in batch.marks)
        if state.table.slots and (polled or ended) and self.store.check(self._all_done_keys(state)):
            out.append(AllDone())
        if now - self._last_return >= self.cfg.detect.node_poll_s:
            self._last_return = now
            out += self._returned(state)
        return out + [Tick()]

    def _all_done_keys(self, state: SupervisorState) -> list[str]:
        """The done keys of the current table's ranks, built once per table."""
        if self._done_keys[0] is not state.table:
            self._done_keys = (state.table, [StoreKey.DONE.of(s.rank) for s in state.table.slots])
        return self._done_keys[1]

    def _drain(self, state: SupervisorState, suspects: dict, timeout: float) -> list[Observation]:
        out: list[Observation] = []
        try:
            seen = self.seen.get(timeout=timeout) if timeout > 0 else self.seen.get_nowait()
        except queue.Empty:
            return out
        while True:
            if seen.kind is SightingKind.CONNECTED and seen.worker_id in state.workers:
                self.connected_at[seen.worker_id] = seen.time
                out.append(Connected(seen.worker_id, seen.pid, seen.time))
            elif seen.kind is SightingKind.CLOSED and state.watched(seen.worker_id):
                suspects.setdefault(seen.worker_id, {"t": seen.time})["process_exited"] = True
            elif seen.kind in (SightingKind.PULSE_CLOSED, SightingKind.NODE_STATE) and seen.node not in state.excluded:
                on = state.watched_on(seen.node)
                if seen.kind is SightingKind.PULSE_CLOSED:
                    self.closes.closed(seen.node, seen.time, on, suspects)
                for wid in on if seen.kind is SightingKind.NODE_STATE else ():
                    suspects.setdefault(wid, {"t": seen.time})["node_state"] = seen.detail
            try:
                seen = self.seen.get_nowait()
            except queue.Empty:
                return out

    def _heartbeats(self, state: SupervisorState, suspects: dict, now: float) -> list[Observation]:
        key = (state.workers, state.table, state.standbys, state.local_standbys, len(self.connected_at))
        if self._live[0] != key:  # rebuilt only when what ``watched`` reads changed, not each period
            self._live = (key, [wid for wid in state.workers if state.watched(wid) and wid in self.connected_at])
        live = self._live[1]
        if not live:
            return []
        # A rank's beat comes in its node's pulse line while that line is fresh (the pulse
        # folds the beats: worker/pulse.py); the store is read only for the others.
        pulses = self.pulses()
        fresh_s = 2 * self.cfg.detect.heartbeat_period_s
        ranks = self._slot_ranks(state)
        times: dict[str, float | None] = {}
        compute: dict[int, float] = {}
        steps, rest = self.steps, []
        for wid in live:
            p = pulses.get(wid)
            if p is not None and p.beat_t > 0 and now - p.t <= fresh_s:
                times[wid] = p.beat_t
                steps[wid] = p.step
                if p.compute_ms >= 0 and wid in ranks:
                    compute[ranks[wid]] = p.compute_ms
            else:
                rest.append(wid)
        beats: dict[str, dict | None] = {}
        if rest:
            keys = self._hb_keys
            for wid in rest:
                if wid not in keys:
                    keys[wid] = StoreKey.HEARTBEAT.of(wid)
            beats = read_heartbeats(self.store, {wid: keys[wid] for wid in rest})
        for wid, b in beats.items():
            times[wid] = b["t"] if b else None
            p = pulses.get(wid)  # a line not fresh still tells when the rank last beat
            if p is not None and p.beat_t > (times[wid] or 0.0):
                times[wid] = p.beat_t
            if b is not None:
                steps[wid] = int(b.get("step", 0))
                if wid in ranks and b.get("compute_ms") is not None:
                    compute[ranks[wid]] = b["compute_ms"]
        out: list[Observation] = []
        if state.recovery is None:
            for rank in self.stragglers.observe(compute, state.table.generation):
                out.append(Straggler(rank, compute[rank], tuple(v for r, v in compute.items() if r != rank)))
        # Ranks: the watchdog decides (a stale heartbeat alone is a suspect, not a fault).
        ranks_t = {w: (t if t is not None else self.connected_at[w]) for w, t in times.items() if w in ranks}
        # the slurmd probe of a node gone quiet (probe.py)
        self._beats.update({w: t for w, t in times.items() if t is not None})
        for w, t in times.items():
            if t is not None and w in ranks:
                node = state.workers[w].node
                if t > self._hb_heard.get(node, 0.0):
                    self._hb_heard[node] = t
        if not self.cfg.detect.silence_s:
            self._probe_early(state, {w: t for w, t in times.items() if w in ranks}, now)
        carried = {w: c for w, b in beats.items() if w in ranks and (c := progress_in(b)) is not None}
        changes = self.progress.observe(ranks_t, pulses, now, paused=state.recovery is not None, hb_progress=carried)
        for wid, (verdict, why) in self.progress.flagged().items():
            if verdict in ACTED_ON:
                suspects.setdefault(wid, {"t": now}).update(heartbeat_stale=True, evidence=why)
        out += [LivenessChange(wid, old, new, why, now) for wid, old, new, why in changes if new not in ACTED_ON]
        # Warm standbys: idle and off the critical path; a fresh pulse of a running process vouches.
        idle_t = {w: t for w, t in times.items() if w not in ranks}
        for wid in stale_workers(idle_t, now, self.cfg.detect.standby_heartbeat_timeout_s, self.connected_at):
            p = pulses.get(wid)
            if p is None or now - p.t > self.cfg.detect.heartbeat_timeout_s or p.state == "T":
                suspects.setdefault(wid, {"t": now})["heartbeat_stale"] = True
        return out

    def _slot_ranks(self, state: SupervisorState) -> dict[str, int]:
        """Worker id -> rank in the current table, built once per table."""
        if self._ranks_of[0] is not state.table:
            self._ranks_of = (state.table, {s.worker_id: s.rank for s in state.table.slots})
        return self._ranks_of[1]

    def liveness(self, worker_id: str) -> str:
        """The watchdog's verdict on a rank, for the status (``ok`` when none)."""
        v = self.progress.verdicts.get(worker_id)
        return v[0].value if v else "ok"

    def _hold_silent(self, state: SupervisorState, suspects: dict[str, dict[str, Any]]) -> None:
        """Move the suspects of silent nodes (and of nodes already held) out of
        ``suspects`` into ``_held`` (``_probed`` gets each a verdict)."""
        by_node: dict[str, list[str]] = {}
        for wid, w in state.workers.items():  # a worker node's own standby is judged on a longer
            if state.watched(wid) and not standbys.is_local(state, wid):  # time-out: its ranks decide
                by_node.setdefault(w.node, []).append(wid)
        touched = {state.workers[wid].node for wid in suspects}
        d, now = self.cfg.detect, time.time()
        quiet_for = max(0.0, d.heartbeat_timeout_s - d.slurmd_probe_deadline_s - d.heartbeat_period_s)
        quiet = {w for n in touched for w in by_node.get(n, []) if now - self._beats.get(w, now) >= quiet_for}
        for node in silent_nodes({n: by_node.get(n, []) for n in touched}, suspects, quiet) | (touched & set(self._held)):
            held = self._held.setdefault(node, {})
            for wid in [x for x in suspects if state.workers[x].node == node]:
                o = suspects.pop(wid)
                held[wid] = {**o, **held.get(wid, {}), **{k: v for k, v in o.items() if k != "t"}}

    def _probe_early(self, state: SupervisorState, ranks_t: Mapping[str, float | None], now: float) -> None:
        """Start the probe of a node whose every rank has been quiet long enough that
        its heartbeats will be stale about when the probe's deadline ends."""
        d = self.cfg.detect
        quiet_for = max(0.0, d.heartbeat_timeout_s - d.slurmd_probe_deadline_s - d.heartbeat_period_s)
        by_node: dict[str, list[str]] = {}
        for wid in ranks_t:
            by_node.setdefault(state.workers[wid].node, []).append(wid)
        for node, wids in by_node.items():
            ts = [ranks_t[w] for w in wids]
            if node not in self._held and all(t is not None for t in ts) and now - max(ts) >= quiet_for:
                self.prober.start(node, [state.workers[w].step_name for w in wids])

    def _probed(self, state: SupervisorState) -> dict[str, tuple[dict[str, Any], NodeProbed | None]]:
        """Held suspects with a verdict on their node (or none: the probe is overdue), by
        worker. A verdict counts if its probe started after the node's newest beat;
        a held node without one gets a probe (no-op while one runs)."""
        out: dict[str, tuple[dict[str, Any], NodeProbed | None]] = {}
        self._verdicts.update({r.node: r for r in self.prober.drain()})
        for node, held in list(self._held.items()):
            newest = max((self._beats.get(w, 0.0) for w in held), default=0.0)
            v = self._verdicts.get(node)
            if v is None or v.started < newest:
                if not self.prober.overdue(node):
                    self.prober.start(node, [state.workers[w].step_name for w in held])
                    continue
                v = None
            if v is not None and partition.held_for_peers(self, state, node, v, held):
                continue
            del self._held[node]
            self._verdicts.pop(node, None)
            for wid, o in held.items():
                if state.watched(wid):
                    out[wid] = (o, v)
        return out

    def _probe(self, state: SupervisorState, suspects: dict[str, dict[str, Any]],
               probed: dict[str, tuple[dict[str, Any], NodeProbed | None]] | None = None) -> Suspects:
        items = []
        both = [(wid, o, None) for wid, o in suspects.items()] + [(w, o, r) for w, (o, r) in (probed or {}).items()]
        reach: dict[str, bool | None] = {}  # one slurmd connect per node, not per rank of it
        for wid, o, res in both:
            w = state.workers[wid]
            slot = state.slot_of(wid)
            finished = slot is not None and self.store.check([StoreKey.DONE.of(slot.rank)])
            if res is not None and not finished:
                reachable = res.reachable
            else:
                if not finished and w.node not in reach:
                    reach[w.node] = self.launcher.node_reachable(w.node, self.cfg.detect.probe_timeout_s)
                reachable = None if finished else reach[w.node]
            h = self.handles.get(wid)
            error = self._program_error(wid) if o.get("process_exited") and slot is not None and not finished else None
            items.append(Suspect(worker_id=wid, t=o["t"], process_exited=o.get("process_exited", False),
                                 heartbeat_stale=o.get("heartbeat_stale", False), node_state=o.get("node_state"),
                                 slurmd_reachable=reachable, still_running=h is not None and h.exit_code() is None,
                                 finished=finished, evidence=o.get("evidence", ""),
                                 slurmd_answers=None if res is None else res.answered,
                                 probe_s=None if res is None else res.ended - o["t"], error=error,
                                 peers_cut=o.get("peers_cut", "")))
        return Suspects(tuple(items))

    def _program_error(self, worker_id: str) -> ProgramError | None:
        """The error a dead rank reported before it exited (``Session._report``), if any:
        written before its process ended, so it is in the store when the death is seen."""
        key = StoreKey.ERROR.of(worker_id)
        try:
            if not self.store.check([key]):
                return None
            return ProgramError.from_json(self.store.get(key))
        except (KeyError, ValueError, TypeError) as exc:  # a malformed record: the death alone counts
            log.warning("unreadable program error of worker %s: %s", worker_id, exc)
            return None

    def poll_events(self, state: SupervisorState) -> list[Observation]:
        """Log the workers' new events; the recovery marks among them become observations.

        Batched: one ``check`` and one ``multi_get`` for all the events counted since the
        last poll (``heartbeats.present_keys``), not a round trip per event."""
        n = self.store.add(StoreKey.EVENT_COUNTER.value, 0)
        numbers = range(self.events_seen + 1, n + 1)
        present = set(present_keys(self.store, [*map(StoreKey.EVENT.of, numbers)])) if n > self.events_seen else set()
        take: list[str] = []
        for i in numbers:
            if StoreKey.EVENT.of(i) not in present:
                # Counted but not yet written: wait a little. A worker killed between
                # counting and writing never writes it; without this every later event
                # (recovery marks included) would wait behind the hole forever.
                now = time.monotonic()
                if self._hole is None or self._hole[0] != i:
                    self._hole = (i, now)
                if now - self._hole[1] < EVENT_HOLE_S:
                    break
                self._late[i] = now  # taken late if it still comes
            else:
                take.append(StoreKey.EVENT.of(i))
            self.events_seen = i
        late = present_keys(self.store, [StoreKey.EVENT.of(k) for k in self._late]) if self._late else []
        for k in list(self._late):
            if StoreKey.EVENT.of(k) in late:
                del self._late[k]
                take.append(StoreKey.EVENT.of(k))
            elif time.monotonic() - self._late[k] > 60:
                del self._late[k]
                self.events.emit(EventKind.EVENT_LOST, n=k)
        return self._take(take)

    def _take(self, keys: list[str]) -> list[Observation]:
        """Log the events under ``keys`` (one ``multi_get``) and remove them from the store."""
        if not keys:
            return []
        marks, lines = [], []
        raws = self.store.multi_get(keys)
        if self.sweep is not None:
            self.sweep(keys)
        else:
            for key in keys:
                self.store.delete_key(key)
        for raw in raws:
            ev = json.loads(bytes(raw))
            kind = ev.pop("kind")
            known = kind in _KNOWN  # else a newer worker's: logged, not acted on
            lines.append((WorkerEvent(kind).logged if known else "rank_" + str(kind), ev))
            if known and kind in _MARKS and ev.get("rank") is not None and ev.get("generation") is not None:
                marks.append(WorkerMark(WorkerEvent(kind), int(ev["rank"]), int(ev["generation"]), float(ev["t"])))
        self.events.emit_many(lines)  # one write for the poll (3 events per rank in a recovery)
        return [WorkerMarks(tuple(marks))] if marks else []

    def _returned(self, state: SupervisorState) -> list[Observation]:
        candidates = returning_candidates(state)
        if not candidates:
            return []
        try:
            states = self.launcher.node_states(candidates)
        except Exception as exc:  # a failing scontrol only delays the scale-out
            log.warning("node state poll failed: %s", exc)
            return []
        return [NodeBack(node, states[node]) for node in candidates
                if states.get(node) and not node_unhealthy(states[node])
                and self.launcher.node_reachable(node, self.cfg.detect.probe_timeout_s)]
