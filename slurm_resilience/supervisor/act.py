"""The supervisor's actions: carry out what the (pure) ladder decided.

    _recover          classify → ladder level → isolate, replace/restart/shrink, publish
    _fallback         a level that timed out → the next coarser one
    _requeue/_abort   job-level endings (requeue after an optional PERSIST generation)
    _migrate/_grow    planned changes without a fault: straggler migration, scale-out

Mixed into :class:`~slurm_resilience.supervisor.loop.Supervisor`, whose state
(table, standbys, excluded, recovery, …) these methods read and change.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

from ..lifecycle import JobPhase
from ..model import Fault, FaultKind
from ..protocol import Plan, PlanAction, Role
from ..slurm.parse import node_state_flags
from .classify import UNHEALTHY_FLAGS, classify_fault, is_node_fault
from .ladder import FaultCase, Level, plan_recovery
from .ranktable import Replacement, grow, regenerate, shrink
from .report import Recovery
from .stop import shut_down_standbys

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_REQUEUED = 0, 3, 4


class Actions:
    """Recovery and planned-change actions of the supervisor (a mixin)."""

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


def _unhealthy(state: str) -> bool:
    return bool(node_state_flags(state) & UNHEALTHY_FLAGS)
