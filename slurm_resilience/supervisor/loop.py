"""The supervisor's only loop: watch → decide → act.

    observations (liveness socket, step exits, heartbeats, node states)
        → classify (pure)        → Fault
        → choose spare / restart (pure) → Replacement
        → regenerate rank table (pure)  → Plan for generation g+1
        → publish plan (stop)  → ranks re-form, restore, roll back, continue
    a recovery not finished by ``online_timeout_s`` falls back to relaunching every
    rank on healthy nodes from node-local snapshots.

The supervisor hosts the store and runs on a node of its own (the batch host):
under ``--no-kill`` a job whose batch host dies is left headless, so that node is
never a worker or a spare.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Sequence

import yaml

from ..config import ResilienceConfig, config_to_dict
from ..errors import ConfigError
from ..events import EventLog
from ..files import makedirs_private, write_private
from ..lifecycle import JobPhase, Lifecycle
from ..model import Fault, FaultKind, RankTable
from ..protocol import (
    EVENT_COUNTER, Plan, PlanAction, Role, WorkerEnv, done_key, event_key,
    heartbeat_key, PERSIST_REQUEST_KEY, write_token,
)
from .classify import UNHEALTHY_FLAGS, classify_fault, is_node_fault
from .detect import LivenessServer, NodeWatcher, Observation, read_heartbeats, stale_workers
from .launcher import Launcher, StepHandle
from .ladder import FaultCase, Level, plan_recovery
from .metrics import Metrics
from .report import Recovery, recovery_phases, status_dict
from .straggler import StragglerPolicy, StragglerWatch
from .ranktable import Replacement, grow, initial_table, regenerate, shrink
from .stop import publish_plan, shut_down_standbys
from ..slurm.parse import node_state_flags

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_REQUEUED = 0, 3, 4


@dataclasses.dataclass
class Worker:
    """A worker process the supervisor started (a rank or a warm standby)."""

    worker_id: str
    node: str
    handle: StepHandle
    connected_at: float | None = None
    pid: int | None = None
    dead: bool = False
    step: int = 0


class Supervisor:
    def __init__(self, *, config: ResilienceConfig, command: Sequence[str], job_dir: str,
                 nodes: Sequence[str], launcher: Launcher, store_host: str,
                 job_id: str = "local", restart_count: int = 0, out=sys.stdout) -> None:
        self.cfg = config
        self.command = list(command)
        self.job_dir = job_dir
        self.launcher = launcher
        self.store_host = store_host
        self.job_id = job_id
        self.restart_count = restart_count
        self.out = out
        self._preempted = threading.Event()
        self._stragglers = StragglerWatch(StragglerPolicy(
            threshold=config.detect.straggler_threshold, window=config.detect.straggler_window))
        need = config.job.nodes + config.job.spares
        if len(nodes) < need:
            raise ConfigError(
                f"the allocation has {len(nodes)} node(s) for workers and spares but "
                f"nodes={config.job.nodes} + spares={config.job.spares} need {need}: "
                "allocate more nodes or lower the counts")
        self.target_world = config.job.nodes
        self.returning: set[str] = set()
        self.worker_nodes = list(nodes[: config.job.nodes])
        self.spare_nodes = list(nodes[config.job.nodes: need])
        self.lifecycle = Lifecycle()
        self.workers: dict[str, Worker] = {}
        self.standbys: dict[str, str] = {}  # node -> worker_id of its warm standby
        self.excluded: set[str] = set()
        self.restarts: dict[int, int] = {}
        self.recovery: Recovery | None = None
        self.recoveries = 0
        self._obs: "queue.Queue[Observation]" = queue.Queue()
        self._ids = 0
        self._ev_seen = 0
        self._t0 = time.time()

    # -- set-up --------------------------------------------------------------
    def _setup(self) -> None:
        import torch.distributed as dist  # the store; imported here so the CLI stays light

        makedirs_private(os.path.join(self.job_dir, "logs"))
        self.token = secrets.token_hex(16)
        write_token(self.job_dir, self.token)
        self.config_path = os.path.join(self.job_dir, "config.yaml")
        write_private(self.config_path, yaml.safe_dump(config_to_dict(self.cfg)))
        self.metrics = Metrics()
        self.events = EventLog(os.path.join(self.job_dir, "events.jsonl"), on_event=self.metrics.observe)
        self._raw_store = dist.TCPStore(self.store_host, 0, None, True, timedelta(seconds=30),
                                        wait_for_workers=False)
        self.store = dist.PrefixStore(self.token + "/", self._raw_store)
        self.liveness = LivenessServer(self.store_host, self.token, self._obs).start()
        self.addresses = {n: self.launcher.address(n) for n in self.worker_nodes + self.spare_nodes}

    def _worker_env(self, worker_id: str, node: str, role: Role, generation: int) -> WorkerEnv:
        return WorkerEnv(
            store_addr=self.store_host, store_port=self._raw_store.port,
            liveness_port=self.liveness.port, token=self.token, job_dir=self.job_dir,
            worker_id=worker_id, node=node, role=role, generation=generation,
            config_path=self.config_path, job_id=self.job_id)

    def _new_id(self, node: str) -> str:
        self._ids += 1
        return f"{node}.{self._ids}"

    def _launch(self, node: str, role: Role, generation: int, worker_id: str | None = None) -> Worker:
        wid = worker_id or self._new_id(node)
        env = self._worker_env(wid, node, role, generation).to_environ()
        log_path = os.path.join(self.job_dir, "logs", f"{wid}.log")
        handle = self.launcher.launch(name=f"sr-{wid}", node=node, argv=self.command,
                                      env=env, log_path=log_path)
        w = Worker(worker_id=wid, node=node, handle=handle)
        self.workers[wid] = w
        return w

    # -- public ----------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end. Returns the exit code (0 done, 3 failed)."""
        self._setup()
        ids = [self._new_id(n) for n in self.worker_nodes]
        self.table: RankTable = initial_table(self.worker_nodes, ids, self.addresses)
        self._publish(Plan(generation=0, action=PlanAction.RUN, table=self.table,
                           joining=tuple(range(self.table.world_size)), reason="start"))
        for slot in self.table.slots:
            self._launch(slot.node, Role.RANK, 0, slot.worker_id)
        for node in self.spare_nodes:
            self.standbys[node] = self._launch(node, Role.STANDBY, 0).worker_id
        self._say(f"job started: {self.table.world_size} ranks on {','.join(self.worker_nodes)}; "
                  f"spares {','.join(self.spare_nodes) or 'none'}")
        self.events.emit("job_start", ranks=list(self.worker_nodes), spares=self.spare_nodes)
        self.lifecycle.transition(JobPhase.RUNNING, "all ranks launched")
        self._install_preempt_handler()
        self.watcher = NodeWatcher(self.launcher.node_states, self._watched_nodes,
                                   self.cfg.detect.node_poll_s, self._obs, _unhealthy).start()
        try:
            return self._watch()
        finally:
            self.watcher.close()
            self.liveness.close()
            self._write_status()
            self.events.close()

    def _install_preempt_handler(self) -> None:
        spec = self.cfg.job.preempt_signal
        if not spec or threading.current_thread() is not threading.main_thread():
            return
        name = spec.split("@")[0]
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name)
        signal.signal(sig, lambda *_: self._preempted.set())

    # -- the loop --------------------------------------------------------------
    def _watch(self) -> int:
        last_hb = last_status = last_return = 0.0
        while True:
            if not self._preempted.is_set() and self.store.check([PERSIST_REQUEST_KEY]):
                self._preempted.set()  # a rank got the preemption signal (sent to the steps)
            if self._preempted.is_set():
                return self._requeue(f"preempted ({self.cfg.job.preempt_signal.split('@')[0]} "
                                     "before the time limit or by the scheduler)", persist=True)
            faults = self._drain_observations(0.02)
            faults.update(self._poll_steps())
            now = time.time()
            if now - last_hb >= self.cfg.detect.heartbeat_period_s:
                last_hb = now
                faults.update(self._check_heartbeats(now))
            faults = {wid: o for wid, o in faults.items() if not self._finished(wid)}
            if faults:
                code = self._recover(faults)
                if code is not None:
                    return code
            self._poll_worker_events()
            if self._all_done():
                return self._finish()
            if self.recovery is not None and time.time() > self.recovery.deadline:
                code = self._fallback()
                if code is not None:
                    return code
            if now - last_status >= 0.5:
                last_status = now
                self._write_status()
            if now - last_return >= self.cfg.detect.node_poll_s:
                last_return = now
                self._check_returned_nodes()

    def _drain_observations(self, timeout: float) -> dict[str, dict]:
        """Liveness and node-state observations → {worker_id: observation flags}."""
        faults: dict[str, dict] = {}
        try:
            obs = self._obs.get(timeout=timeout)
        except queue.Empty:
            return faults
        while True:
            if obs.kind == "connected" and obs.worker_id in self.workers:
                w = self.workers[obs.worker_id]
                w.connected_at, w.pid = obs.time, obs.pid
                if w.node in self.returning and self.standbys.get(w.node) == w.worker_id:
                    self._grow(w.node)
            elif obs.kind == "closed" and self._watched(obs.worker_id):
                faults.setdefault(obs.worker_id, {"t": obs.time})["process_exited"] = True
            elif obs.kind == "node_state" and obs.node not in self.excluded:
                for w in self.workers.values():
                    if w.node == obs.node and self._watched(w.worker_id):
                        faults.setdefault(w.worker_id, {"t": obs.time})["state"] = obs.detail
            try:
                obs = self._obs.get_nowait()
            except queue.Empty:
                return faults

    def _poll_steps(self) -> dict[str, dict]:
        faults = {}
        for w in self.workers.values():
            if self._watched(w.worker_id) and w.handle.exit_code() is not None:
                faults[w.worker_id] = {"t": time.time(), "process_exited": True}
        return faults

    def _check_heartbeats(self, now: float) -> dict[str, dict]:
        live = {wid: w for wid, w in self.workers.items() if self._watched(wid) and w.connected_at}
        if not live:
            return {}
        beats = read_heartbeats(self.store, {wid: heartbeat_key(wid) for wid in live})
        for wid, beat in beats.items():
            if beat is not None:
                live[wid].step = int(beat.get("step", 0))
        self._watch_stragglers(beats)
        times = {wid: (b["t"] if b else None) for wid, b in beats.items()}
        started = {wid: w.connected_at for wid, w in live.items()}
        stale = stale_workers(times, now, self.cfg.detect.heartbeat_timeout_s, started)
        return {wid: {"t": now, "heartbeat_stale": True} for wid in stale}

    def _watch_stragglers(self, beats: dict[str, dict | None]) -> None:
        ranks = {s.worker_id: s.rank for s in self.table.slots}
        compute = {ranks[w]: b["compute_ms"] for w, b in beats.items()
                   if b and w in ranks and b.get("compute_ms") is not None}
        if self.recovery is not None:
            return
        for rank in self._stragglers.observe(compute):
            slot = self.table.slots[rank]
            peers = sorted(v for r, v in compute.items() if r != rank)
            self.events.emit("straggler", rank=rank, node=slot.node, compute_ms=compute[rank], peers_ms=peers)
            self._say(f"straggler: rank {rank} on {slot.node}: {compute[rank]:.1f} ms of compute per step, "
                      f"peers {peers[len(peers) // 2]:.1f} ms")
            if self.cfg.recovery.migrate_stragglers and self.standbys:
                self._migrate(rank)
                return

    def _migrate(self, rank: int) -> None:
        """Planned replacement of a slow node at the next safe point: no fault, no step lost."""
        slot = self.table.slots[rank]
        detected = time.time()
        spare = next(iter(self.standbys))
        move = Replacement(rank, slot.node, spare, self.standbys.pop(spare))
        self.workers[slot.worker_id].dead = True  # it will be fenced out and exit
        self.excluded.add(slot.node)
        threading.Thread(target=self._isolate_quietly, args=(slot.node, "straggler"), daemon=True).start()
        table = regenerate(self.table, [move], self.addresses)
        marks = {"classified": time.time(), "replaced": time.time()}
        if self.lifecycle.phase is JobPhase.RUNNING:
            self.lifecycle.transition(JobPhase.RECOVERING, f"migrating straggler rank {rank}")
        self._publish(Plan(generation=table.generation, action=PlanAction.RUN, table=table,
                           joining=(rank,), reason=f"straggler rank {rank} on {slot.node}"))
        marks["published"] = time.time()
        self._begin_recovery("straggler-migration", table.generation, [], detected, marks)
        self._stragglers.reset()

    def _isolate_quietly(self, node: str, why: str) -> None:
        try:
            self.launcher.isolate(node, "DRAIN", f"slurm_resilience job {self.job_id}: {why}")
            self.events.emit("isolated", node=node, state="DRAIN", reason=why)
        except Exception as exc:  # reported, never fatal
            self.events.emit("isolate_failed", node=node, error=str(exc))

    def _check_returned_nodes(self) -> None:
        """After a scale-in, a node of this allocation that is healthy again (drained
        node resumed by an admin, slurmd answering) gets a standby; it joins next."""
        if self.table.world_size >= self.target_world or self.recovery is not None:
            return
        pool = set(self.worker_nodes) | set(self.spare_nodes)
        candidates = sorted(n for n in self.excluded if n in pool and n not in self.returning)
        if not candidates:
            return
        try:
            states = self.launcher.node_states(candidates)
        except Exception as exc:  # a failing scontrol only delays the scale-out
            log.warning("node state poll failed: %s", exc)
            return
        for node in candidates:
            state = states.get(node)
            if state and not _unhealthy(state) and self.launcher.node_reachable(
                    node, self.cfg.detect.probe_timeout_s):
                self.excluded.discard(node)
                self.returning.add(node)
                self.standbys[node] = self._launch(node, Role.STANDBY, self.table.generation).worker_id
                self.events.emit("node_returned", node=node, state=state)
                self._say(f"node {node} is back in service ({state}): starting a standby to scale out")

    def _grow(self, node: str) -> None:
        """Planned scale-out at the next safe point: the standby on ``node`` becomes a rank."""
        self.returning.discard(node)
        if self.table.world_size >= self.target_world or self.recovery is not None:
            return  # stays a spare
        detected = time.time()
        wid = self.standbys.pop(node)
        self.addresses.setdefault(node, self.launcher.address(node))
        table = grow(self.table, node, wid, self.addresses)
        marks = {"classified": time.time(), "replaced": time.time()}
        if self.lifecycle.phase is JobPhase.RUNNING:
            self.lifecycle.transition(JobPhase.RECOVERING, f"scaling out onto {node}")
        self._publish(Plan(generation=table.generation, action=PlanAction.RUN, table=table,
                           joining=(table.world_size - 1,), reason=f"scale out onto returned node {node}"))
        marks["published"] = time.time()
        self._begin_recovery("scale-out", table.generation, [], detected, marks)

    def _watched(self, worker_id: str | None) -> bool:
        """A live rank of the current table, or a standby still in the pool."""
        w = self.workers.get(worker_id) if worker_id else None
        if w is None or w.dead:
            return False
        in_table = any(s.worker_id == worker_id for s in self.table.slots)
        return in_table or self.standbys.get(w.node) == worker_id

    def _finished(self, worker_id: str) -> bool:
        """A rank that reported done may exit: that is not a fault."""
        slot = next((s for s in self.table.slots if s.worker_id == worker_id), None)
        if slot is not None and self.store.check([done_key(slot.rank)]):
            self.workers[worker_id].dead = True
            return True
        return False

    def _watched_nodes(self) -> list[str]:
        return [n for n in set(self.table.nodes) | set(self.standbys) if n not in self.excluded]

    # -- recovery ----------------------------------------------------------------
    def _recover(self, observed: dict[str, dict]) -> int | None:
        """Classify what was observed, choose a ladder level (pure), carry it out."""
        detected = min(o["t"] for o in observed.values())
        cases: list[FaultCase] = []
        faults: list[Fault] = []
        for wid, o in observed.items():
            w = self.workers[wid]
            w.dead = True
            reachable = self.launcher.node_reachable(w.node, self.cfg.detect.probe_timeout_s)
            slot = next((s for s in self.table.slots if s.worker_id == wid), None)
            fault = classify_fault(
                rank=slot.rank if slot else None, node=w.node,
                process_exited=o.get("process_exited", False), slurmd_reachable=reachable,
                heartbeat_stale=o.get("heartbeat_stale", False),
                slurm_node_state=o.get("state"), now=time.time())
            self.events.emit("fault_detected", fault=fault.to_dict(), observed_at=o["t"], worker_id=wid)
            self._say(f"fault: {'rank ' + str(fault.rank) if slot else 'spare'} on {w.node}: "
                      f"{fault.kind.name} ({fault.detail})")
            if fault.kind is FaultKind.PROCESS_HUNG or (reachable and w.handle.exit_code() is None):
                self.launcher.kill(w.handle)
            if slot is None:  # a standby lost: the pool shrinks
                self.standbys.pop(w.node, None)
                if is_node_fault(fault.kind):
                    self._isolate(w.node, fault)
                continue
            faults.append(fault)
            cases.append(FaultCase(slot.rank, w.node, fault.kind, self.restarts.get(slot.rank, 0)))
        if not cases:
            return None
        rc = self.cfg.recovery
        plan = plan_recovery(
            cases, spares=[n for n in self.standbys if n not in self.excluded],
            world_size=self.table.world_size, retry_budget=rc.fault_retry_times,
            min_world_size=rc.min_world_size, scale_in=rc.scale_in, relaunch=rc.fallback_relaunch,
            requeues_used=self.restart_count, max_requeues=self._max_requeues())
        for node in plan.isolate:
            self._isolate(node, next((f for f in faults if f.node == node), faults[0]))
        self.events.emit("ladder", level=plan.level.value, reason=plan.reason)
        classified = time.time()
        if plan.level is Level.FAIL:
            return self._abort(f"cannot recover: {plan.reason}; add spares (--spares) or resubmit "
                               "to resume from the newest checkpoint")
        if plan.level is Level.REQUEUE:
            return self._requeue(plan.reason, persist=False)
        moves = [Replacement(r, self.table.slots[r].node, node, self.standbys.pop(node))
                 for r, node in plan.spares]
        for r in plan.restarts:
            self.restarts[r] = self.restarts.get(r, 0) + 1
        restarts = [Replacement(r, self.table.slots[r].node, self.table.slots[r].node,
                                self._new_id(self.table.slots[r].node)) for r in plan.restarts]
        new_table = regenerate(self.table, moves + restarts, self.addresses)
        if plan.lost:
            new_table = shrink(new_table, plan.lost)
            new_table = dataclasses.replace(new_table, generation=self.table.generation + 1)
        replaced = time.time()
        if self.lifecycle.phase is JobPhase.RUNNING:
            self.lifecycle.transition(JobPhase.RECOVERING, faults[0].detail)
        gen = new_table.generation
        joining = tuple(s.rank for s in new_table.slots
                        if s.worker_id in {m.new_worker_id for m in moves + restarts})
        self._publish(Plan(generation=gen, action=PlanAction.RUN, table=new_table,
                           joining=joining, reason=plan.reason))
        published = time.time()
        for r in restarts:
            self._launch(r.new_node, Role.RANK, gen, r.new_worker_id)
        self._begin_recovery(plan.level.value, gen, faults, detected,
                             {"classified": classified, "replaced": replaced, "published": published})
        return None

    def _begin_recovery(self, level: str, gen: int, faults: list[Fault], detected: float,
                        marks: dict[str, float]) -> None:
        self.recoveries += 1
        self.events.emit("recovery_start", recovery=self.recoveries, t=detected, level=level,
                         generation=gen)
        self.recovery = Recovery(
            number=self.recoveries, generation=gen, level=level, faults=faults,
            marks={"detected": detected, **marks},
            deadline=marks["published"] + self.cfg.recovery.online_timeout_s)
        self._say(f"recovery {self.recoveries}: {level}, generation {gen} published "
                  f"{(marks['published'] - detected) * 1000:.1f} ms after detection")

    def _max_requeues(self) -> int:
        return self.cfg.recovery.max_requeues if hasattr(self.launcher, "requeue") else 0

    def _requeue(self, reason: str, *, persist: bool) -> int:
        """Job-level: ranks stop (after a durable checkpoint when ``persist``), then
        ``scontrol requeue``; the requeued job resumes from the newest checkpoint."""
        self._say(f"requeue: {reason}")
        self.events.emit("requeue_start", reason=reason, persist=persist)
        gen = self.table.generation + 1
        if persist:  # same ranks, a fresh group: they agree on the newest step, persist it, exit
            self.table = dataclasses.replace(self.table, generation=gen)
            self._publish(Plan(generation=gen, action=PlanAction.PERSIST, table=self.table, reason=reason))
        else:
            self._publish(Plan(generation=gen, action=PlanAction.STOP, table=self.table, reason=reason))
        shut_down_standbys(self.store)
        self._reap(grace_s=self.cfg.recovery.fallback_timeout_s)
        self._poll_worker_events()
        self.events.emit("requeue", reason=reason, restart_count=self.restart_count)
        if self.lifecycle.phase is not JobPhase.FAILED:
            self.lifecycle.transition(JobPhase.FAILED, f"requeued: {reason}")
        if hasattr(self.launcher, "requeue"):
            self.launcher.requeue()
        else:  # no scheduler (local mode): the user reruns the same job directory to resume
            self._say("no scheduler to requeue with: run the job again in the same job directory to resume")
        return EXIT_REQUEUED

    def _isolate(self, node: str, fault: Fault) -> None:
        """Take the node out of service in the background: Slurm bookkeeping is off the critical path."""
        self.excluded.add(node)
        state = self.cfg.recovery.isolate_state
        reason = f"slurm_resilience job {self.job_id}: {fault.kind.name.lower()}"

        def work() -> None:
            t0 = time.time()
            try:
                self.launcher.isolate(node, state, reason)
                self.events.emit("isolated", node=node, state=state, start=t0, end=time.time())
            except Exception as exc:  # reported, never fatal: the node is excluded regardless
                self.events.emit("isolate_failed", node=node, error=str(exc))

        threading.Thread(target=work, name=f"sr-isolate-{node}", daemon=True).start()

    def _fallback(self) -> int | None:
        """Online recovery timed out: relaunch every rank on its (healthy) node from snapshots."""
        rec = self.recovery
        if rec.level == Level.PROCESS_RESTART.value or not self.cfg.recovery.fallback_relaunch:
            reason = (f"recovery of generation {rec.generation} ({rec.level}) did not train a step "
                      "within its time-out")
            if self.restart_count < self._max_requeues():
                return self._requeue(reason, persist=False)
            return self._abort(reason)
        self._say(f"online recovery timed out after {self.cfg.recovery.online_timeout_s:g}s: "
                  "relaunching all ranks from node-local snapshots")
        self.events.emit("fallback", generation=rec.generation)
        for slot in self.table.slots:
            w = self.workers[slot.worker_id]
            w.dead = True
            self.launcher.kill(w.handle)
        moves = [Replacement(s.rank, s.node, s.node, self._new_id(s.node)) for s in self.table.slots]
        new_table = regenerate(self.table, moves, self.addresses)
        self._publish(Plan(generation=new_table.generation, action=PlanAction.RUN, table=new_table,
                           joining=tuple(range(new_table.world_size)), reason="fallback relaunch"))
        for m in moves:
            self._launch(m.new_node, Role.RANK, new_table.generation, m.new_worker_id)
        if self.lifecycle.phase is not JobPhase.FALLBACK_RELAUNCH:
            self.lifecycle.transition(JobPhase.FALLBACK_RELAUNCH, "online recovery timed out")
        rec.level, rec.generation = Level.PROCESS_RESTART.value, new_table.generation
        rec.worker_marks.clear()
        rec.marks["published"] = time.time()
        rec.deadline = time.time() + self.cfg.recovery.fallback_timeout_s
        return None

    def _publish(self, plan: Plan) -> None:
        publish_plan(self.store, plan, self.job_dir)
        self._stragglers.reset()  # ranks may be renumbered
        self.table = plan.table
        self.events.emit("plan", generation=plan.generation, action=plan.action.value,
                         nodes=list(plan.table.nodes), joining=list(plan.joining),
                         reason=plan.reason)

    # -- worker events -------------------------------------------------------------
    def _poll_worker_events(self) -> None:
        n = self.store.add(EVENT_COUNTER, 0)
        while self._ev_seen < n:
            key = event_key(self._ev_seen + 1)
            if not self.store.check([key]):
                return  # counted but not yet written: next tick
            ev = json.loads(self.store.get(key))
            self.store.delete_key(key)
            self._ev_seen += 1
            kind = ev.pop("kind")
            self.events.emit(f"rank_{kind}", **ev)
            self._track_recovery(kind, ev)

    def _track_recovery(self, kind: str, ev: dict) -> None:
        rec = self.recovery
        if rec is None or ev.get("generation") != rec.generation or ev.get("rank") is None:
            return
        if kind in ("reconnected", "restored", "first_step", "done"):
            key = "first_step" if kind == "done" else kind
            rec.worker_marks.setdefault(key, {}).setdefault(ev["rank"], ev["t"])
        if len(rec.worker_marks.get("first_step", {})) == self.table.world_size:
            self._recovery_done(rec)

    def _recovery_done(self, rec: Recovery) -> None:
        for phase, start, end in recovery_phases(rec):
            self.events.emit("phase", recovery=rec.number, phase=phase, start=start, end=end,
                             duration_ms=round((end - start) * 1000, 3))
        last = {k: max(v.values()) for k, v in rec.worker_marks.items()}
        m = rec.marks
        total = last["first_step"] - m["detected"]
        self.events.emit("recovery_done", t=last["first_step"], recovery=rec.number, level=rec.level,
                         generation=rec.generation, detected=m["detected"],
                         first_step=last["first_step"], detect_to_step_s=total)
        self._say(f"recovery {rec.number} done: generation {rec.generation} trained a step "
                  f"{total * 1000:.0f} ms after detection")
        self.recovery = None
        self.lifecycle.transition(JobPhase.RUNNING, f"recovery {rec.number} done")

    # -- endings -------------------------------------------------------------------
    def _all_done(self) -> bool:
        if not self.store.check([done_key(s.rank) for s in self.table.slots]):
            return False
        if self.recovery is not None:
            self._poll_worker_events()  # "done" events also close a recovery in flight
        return self.recovery is None

    def _finish(self) -> int:
        self.lifecycle.transition(JobPhase.FINISHING, "every rank finished")
        shut_down_standbys(self.store)
        self._reap()
        self._poll_worker_events()
        self.lifecycle.transition(JobPhase.SUCCEEDED)
        self.events.emit("job_done", recoveries=self.recoveries, generation=self.table.generation)
        self._say(f"job finished after {self.recoveries} recover{'y' if self.recoveries == 1 else 'ies'}")
        return EXIT_OK

    def _abort(self, reason: str) -> int:
        gen = self.table.generation + 1
        self._publish(Plan(generation=gen, action=PlanAction.ABORT, table=self.table, reason=reason))
        shut_down_standbys(self.store)
        self._reap()
        self._poll_worker_events()
        if self.lifecycle.phase is not JobPhase.FAILED:
            self.lifecycle.transition(JobPhase.FAILED, reason)
        self.events.emit("job_failed", reason=reason)
        print(f"slurm-resilience: error: {reason}", file=sys.stderr, flush=True)
        return EXIT_FAILED

    def _reap(self, grace_s: float = 30.0) -> None:
        deadline = time.time() + grace_s
        for w in self.workers.values():
            while w.handle.exit_code() is None and time.time() < deadline:
                time.sleep(0.05)
            if w.handle.exit_code() is None and not w.dead:
                self.launcher.kill(w.handle)

    # -- reporting -----------------------------------------------------------------
    def _say(self, text: str) -> None:
        print(f"[sr +{time.time() - self._t0:8.3f}s] {text}", file=self.out, flush=True)

    def _write_status(self) -> None:
        status = status_dict(self, self.workers)
        write_private(os.path.join(self.job_dir, "status.json"), json.dumps(status))
        write_private(os.path.join(self.job_dir, "metrics.prom"), self.metrics.render(status))


def _unhealthy(state: str) -> bool:
    return bool(node_state_flags(state) & UNHEALTHY_FLAGS)
