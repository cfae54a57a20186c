"""Pure: faults → one recovery plan → the actions of its ladder level (used by ``decide``).

    Suspects (online) / StepFaults (relaunch)
        → classify (classify.py)           → Fault per worker
        → plan_recovery (ladder.py)        → RecoveryPlan: level, spares, restarts, lost, isolate
        → carry_out                        → Isolate, Publish / Relaunch, Launch, Kill, recovery marks
    Tick past a recovery's deadline → the same ladder with the level in ``failed`` and
    ``timed_out`` (so: PROCESS_RESTART, then REQUEUE, then FAIL) — no level written twice.

Planned changes use the same publish path: a straggler moved to a spare, and a
returned node joining again (scale back out).
"""

from __future__ import annotations

import dataclasses
import math

from ...lifecycle import JobPhase
from ...model import Fault, FaultKind
from ...protocol import EventKind, Plan, PlanAction, Role
from .classify import classify_fault, is_node_fault
from .ladder import RUNGS, FaultCase, LadderInput, Level, RecoveryPlan, choose_level, plan_recovery
from . import blame, relaunch_recovery, spares
from . import standbys as node_standbys
from .actions import Decision, abort, launch, move, publish, requeue
from .messages import Action, Isolate, Kill, Relaunch, Say, StepFaults, Straggler, Suspects, emit
from .report import Mark
from .ranktable import Replacement, grow as grow_table, in_node_order, regenerate, shrink
from .state import Mode, Policy, Recovery, SupervisorState, is_process_fault


def on_suspects(state: SupervisorState, obs: Suspects, now: float, policy: Policy) -> Decision:
    """Online: classify each watched suspect, end what must be ended, plan the incident."""
    acts: list[Action] = []
    faults: list[Fault] = []
    errors: list[blame.ErrorSeen] = []
    if obs.bad_spares:
        state = dataclasses.replace(state, excluded=state.excluded | obs.bad_spares)
    items = [s for s in obs.items if state.watched(s.worker_id)]
    if not items:
        return state, []
    detected = min(s.t for s in items)
    for s in items:
        if not state.watched(s.worker_id):  # lost with an earlier suspect's node: its ranks, its standbys
            continue
        w = state.workers[s.worker_id]
        state = state.with_dead(s.worker_id)
        if s.finished:  # a rank that reported done may exit
            continue
        slot = state.slot_of(s.worker_id)
        fault = classify_fault(rank=slot.rank if slot else None, node=w.node, process_exited=s.process_exited,
                               slurmd_reachable=s.slurmd_reachable, heartbeat_stale=s.heartbeat_stale,
                               slurm_node_state=s.node_state, now=now, slurmd_answers=s.slurmd_answers,
                               peers_cut=s.peers_cut)
        if s.evidence and fault.kind is FaultKind.PROCESS_HUNG:  # the watchdog's evidence, not "stale"
            fault = dataclasses.replace(fault, detail=f"{s.evidence}; {fault.detail.split(', ', 1)[-1]}")
        probe = {} if s.probe_s is None else {"slurmd_answers": s.slurmd_answers, "probe_s": round(s.probe_s, 4)}
        if s.error is not None:
            probe["program_error"] = s.error.to_dict()
        acts += [emit(EventKind.FAULT_DETECTED, fault=fault.to_dict(), observed_at=s.t, worker_id=s.worker_id,
                      **probe),
                 Say(f"fault: {'rank ' + str(fault.rank) if slot else 'spare'} on {w.node}: "
                     f"{fault.kind.name} ({fault.detail})" + (f": {s.error.headline}" if s.error else ""))]
        if slot is not None and is_process_fault(fault.kind):  # evidence for blame.py
            state = dataclasses.replace(state, process_failures={
                **state.process_failures, w.node: state.process_failures.get(w.node, 0) + 1})
            if s.error is not None:
                errors.append(blame.ErrorSeen(slot.rank, w.node, state.recoveries, s.error))
        if fault.kind is FaultKind.PROCESS_HUNG or (s.slurmd_reachable and s.still_running):
            acts.append(Kill(s.worker_id))
        if slot is None and node_standbys.is_local(state, s.worker_id):  # a node's own standby lost:
            state = node_standbys.forget(state, s.worker_id)  # its node's ranks (or spare pool) speak for the node
            continue  # (isolating it here would strand them on an excluded node)
        if slot is None:  # a standby lost: its node can no longer take over a whole node
            pool = state.standbys.get(w.node, ())
            state = dataclasses.replace(state.with_dead(*pool),
                                        standbys={n: x for n, x in state.standbys.items() if n != w.node})
            acts += [Kill(x) for x in pool if x != s.worker_id]
            state, more = node_standbys.drop(state, w.node, kill=not is_node_fault(fault.kind))  # a spare's extra ones
            acts += more
            if is_node_fault(fault.kind):
                state, more = _isolate(state, w.node, fault.kind, policy)
                acts += more
            continue
        if is_node_fault(fault.kind):  # the node's other ranks are lost with it
            mates = [state.table.slots[r].worker_id for r in state.table.ranks_on(w.node) if r != slot.rank]
            state = state.with_dead(*mates)
            if s.slurmd_reachable:
                acts += [Kill(x) for x in mates]
            state, more = node_standbys.drop(state, w.node, kill=s.slurmd_reachable)
            acts += more
        faults.append(fault)
    if errors:
        verdict = blame.program_verdict(state.errors, errors, nodes_in_job=len(state.table.node_list))
        state = dataclasses.replace(state, errors=blame.remember(state.errors, errors))
        if verdict is not None:  # the program's own bug: fail once, take no node, requeue nothing
            e = verdict.first
            state, more = abort(state, verdict.message(), policy, traceback=e.error.traceback,
                                program_error=e.error.to_dict(), rank=e.rank, node=e.node, ranks=list(verdict.ranks))
            return state, acts + more
    if not faults:
        return state, acts
    state, more = incident(state, faults, detected, now, policy)
    return state, acts + more


def on_step_faults(state: SupervisorState, obs: StepFaults, now: float, policy: Policy) -> Decision:
    """Relaunch mode: the step's faults, with each lost node's rank from the table."""
    if obs.bad_spares:
        state = dataclasses.replace(state, excluded=state.excluded | obs.bad_spares)
    state, acts, faults = relaunch_recovery.step_faults(state, obs)  # its lines; an open recovery closes
    state, more = incident(state, faults, obs.t, now, policy)
    return state, acts + more


def incident(state: SupervisorState, faults: list[Fault], detected: float, now: float,
             policy: Policy, *, isolate_state: str | None = None) -> Decision:
    """One plan for every fault seen together. A node fault is one case for the whole
    node (its G ranks are lost together); a process fault is one case for its rank."""
    cases: list[FaultCase] = []
    seen_nodes: set[str] = set()
    for f in faults:
        if is_node_fault(f.kind) and f.rank is not None:
            if f.node in seen_nodes:
                continue
            seen_nodes.add(f.node)
            cases.append(FaultCase(f.rank, f.node, f.kind, ranks=state.table.ranks_on(f.node)))
        else:
            cases.append(FaultCase(f.rank, f.node, f.kind, node_suspect=is_process_fault(f.kind) and f.rank is not None
                                   and blame.node_suspect(state.process_failures, f.node)))
    plan = plan_recovery(cases, spares=state.free_spares(policy.mode), world_size=state.table.world_size,
                         policy=policy.ladder, retries_used=state.fault_retries_used,
                         requeues_used=state.requeue_count)
    acts: list[Action] = []
    for node in plan.isolate:
        state, more = _isolate(state, node, next((f.kind for f in faults if f.node == node), faults[0].kind), policy,
                               state_override=isolate_state)
        acts += more
    acts.append(emit(EventKind.LADDER, level=plan.level, reason=plan.reason))
    state, more = carry_out(state, plan, tuple(cases), frozenset(), detected, now, policy, why=faults[0].detail)
    return state, acts + more


def carry_out(state: SupervisorState, plan: RecoveryPlan, cases: tuple[FaultCase, ...], failed: frozenset[Level],
              detected: float, now: float, policy: Policy, *, why: str) -> Decision:
    """The actions of ``plan.level`` (any level, fresh or after a time-out)."""
    if plan.level is Level.FAIL:
        return abort(state, _fail_message(state, cases, plan, policy), policy,
                     **blame.last_error(state.errors, cases, state.recoveries))
    if plan.level is Level.REQUEUE:
        return requeue(state, plan.reason, policy, persist=False)
    if plan.level is Level.PROCESS_RESTART:
        return _relaunch_all(state, cases, failed, detected, now, policy, reason=plan.reason)
    moves: list[Replacement] = []
    standbys = dict(state.standbys)
    recheck: list[Action] = []
    for rank, spare in plan.spares:  # the lost node's G ranks move to the spare node together
        old = state.table.slots[rank].node
        warm = standbys.pop(spare, ())
        if policy.mode is Mode.ONLINE and spares.stale(state, spare, now, policy):
            state, more = spares.check(state, spare)  # in parallel: the recovery does not wait
            recheck += more
        for r in state.table.ranks_on(old):
            lr = state.table.slots[r].local_rank
            if lr < len(warm):
                wid = warm[lr]
            else:
                state, wid = state.new_id(spare)
            moves.append(Replacement(r, old, spare, wid))
    state = dataclasses.replace(state, standbys=standbys)
    if plan.restarts:
        state = dataclasses.replace(state, fault_retries_used=state.fault_retries_used + 1)
    in_place, adopted = [], []
    for r in plan.restarts:  # the node's warm standby takes the slot if it can, else a new process
        node = state.table.slots[r].node
        state, wid = node_standbys.take(state, node, policy)
        if wid is None:
            state, wid = state.new_id(node)
            in_place.append(Replacement(r, node, node, wid))
        else:
            adopted.append(Replacement(r, node, node, wid))
    moves += in_place + adopted
    table = regenerate(state.table, moves, state.addresses)
    if plan.lost:  # whole nodes leave
        lost = [r for rank in plan.lost for r in state.table.ranks_on(state.table.slots[rank].node)]
        table = dataclasses.replace(shrink(table, lost), generation=state.table.generation + 1)
    if policy.mode is Mode.RELAUNCH:
        return _relaunch(state, table, plan.reason, level=plan.level, cases=cases, failed=failed,
                         detected=detected, now=now)
    state, acts = move(state, JobPhase.RECOVERING, why)
    new_ids = {m.new_worker_id for m in moves}
    joining = tuple(s.rank for s in table.slots if s.worker_id in new_ids)
    state, more = publish(state, Plan(generation=table.generation, action=PlanAction.RUN, table=table,
                                      joining=joining, reason=plan.reason), recovery=True)
    acts += more
    for m in in_place:  # a restart in place is a new process; a spare's standby already runs
        state, act = launch(state, m.new_node, Role.RANK, table.generation, m.new_worker_id)
        acts.append(act)
    acts += [emit(EventKind.LOCAL_STANDBY_ADOPTED, rank=m.rank, node=m.new_node, worker_id=m.new_worker_id,
                  generation=table.generation) for m in adopted]
    state, more = begin(state, plan.level, cases, failed, detected, now, table.generation)
    return state, acts + more + recheck


def begin(state: SupervisorState, level: Level, cases: tuple[FaultCase, ...], failed: frozenset[Level],
          detected: float, now: float, generation: int) -> Decision:
    """A recovery starts; its deadline starts when its plan is out (``Published``)."""
    n = state.recoveries + 1
    rec = Recovery(number=n, generation=generation, level=level, cases=cases, failed=failed,
                   marks={Mark.DETECTED: detected, Mark.CLASSIFIED: now, Mark.REPLACED: now}, deadline=math.inf)
    return dataclasses.replace(state, recoveries=n, recovery=rec), [
        emit(EventKind.RECOVERY_START, recovery=n, t=detected, level=level, generation=generation)]


def on_tick(state: SupervisorState, now: float, policy: Policy) -> Decision:
    """A recovery past its deadline: ask the ladder again, with its level failed."""
    rec = state.recovery
    if rec is None or now <= rec.deadline:
        return state, []
    failed = rec.failed | ({rec.level} if rec.level in RUNGS else set())
    d = choose_level(LadderInput(
        fault=FaultKind.PROCESS_HUNG, spares_left=0, retries_used=state.fault_retries_used,
        retry_budget=policy.ladder.retry_budget, world_size=state.table.world_size,
        relaunch=policy.ladder.relaunch, online=policy.ladder.online, requeues_used=state.requeue_count,
        max_requeues=policy.ladder.max_requeues, failed=failed, timed_out=True))
    reason = f"recovery of generation {rec.generation} ({rec.level}) did not train a step within its time-out"
    plan = RecoveryPlan(level=d.level, reason=reason)
    state = dataclasses.replace(state, recovery=dataclasses.replace(rec, failed=failed))
    return carry_out(state, plan, rec.cases, failed, rec.marks[Mark.DETECTED], now, policy, why=reason)


def _relaunch_all(state: SupervisorState, cases, failed, detected: float, now: float, policy: Policy,
                  *, reason: str) -> Decision:
    """PROCESS_RESTART: every rank anew on its (healthy) node, from the checkpoint tiers.
    Each node's warm standbys (recovery.local_standbys: idle processes, not the possibly
    hung survivors, on a node not excluded; a former spare brought its extra ones) take
    that node's first K slots; the node's other slots get new processes."""
    moves, adopted = [], []
    for slot in state.table.slots:
        state, wid = node_standbys.take(state, slot.node, policy)
        if wid is None:
            state, wid = state.new_id(slot.node)
            moves.append(Replacement(slot.rank, slot.node, slot.node, wid))
        else:
            adopted.append(Replacement(slot.rank, slot.node, slot.node, wid))
    moves += adopted
    table = regenerate(state.table, moves, state.addresses)
    if state.recovery is None:  # a fresh incident answered by relaunching (a retry in place)
        state = dataclasses.replace(state, fault_retries_used=state.fault_retries_used + 1)
    if policy.mode is Mode.RELAUNCH:
        return _relaunch(state, table, reason, level=Level.PROCESS_RESTART, cases=cases, failed=failed,
                         detected=detected, now=now)
    old = [s.worker_id for s in state.table.slots]
    acts: list[Action] = []
    if state.recovery is not None:
        acts += [Say(f"recovery {state.recovery.number} ({state.recovery.level}) timed out: "
                     "relaunching all ranks from node-local snapshots"),
                 emit(EventKind.FALLBACK, generation=state.recovery.generation)]
    state = state.with_dead(*old)
    acts += [Kill(w) for w in old]
    state, more = publish(state, Plan(generation=table.generation, action=PlanAction.RUN, table=table,
                                      joining=tuple(range(table.world_size)), reason="fallback relaunch"),
                          recovery=True)
    acts += more
    for m in moves:
        if m in adopted:
            acts.append(emit(EventKind.LOCAL_STANDBY_ADOPTED, rank=m.rank, node=m.new_node,
                             worker_id=m.new_worker_id, generation=table.generation))
        else:
            state, act = launch(state, m.new_node, Role.RANK, table.generation, m.new_worker_id)
            acts.append(act)
    to = JobPhase.FALLBACK_RELAUNCH if state.phase is not JobPhase.RUNNING else JobPhase.RECOVERING
    state, more = move(state, to, reason)
    acts += more
    if state.recovery is not None:  # the same recovery, one level coarser
        rec = dataclasses.replace(state.recovery, level=Level.PROCESS_RESTART, generation=table.generation,
                                  worker_marks={}, deadline=math.inf)
        return dataclasses.replace(state, recovery=rec), acts
    state, more = begin(state, Level.PROCESS_RESTART, cases, failed, detected, now, table.generation)
    return state, acts + more


def _relaunch(state: SupervisorState, table, reason: str, *, level: Level, cases, failed, detected: float,
              now: float) -> Decision:
    """Relaunch mode: the next all-ranks step (in place, or with spares in lost slots); a
    recovery starts (it ends at the step's first progress line, ``relaunch_recovery``)."""
    attempt = state.relaunches + 1
    previous = list(state.table.node_list)
    table = in_node_order(table, (*state.worker_nodes, *state.spare_nodes))  # Slurm's task order
    state = dataclasses.replace(state, table=table, relaunches=attempt)
    state, acts = move(state, JobPhase.RECOVERING, reason)
    state, more = begin(state, level, cases, failed, detected, now, table.generation)
    acts += [*more, relaunch_recovery.relaunching(state.recovery, attempt, table.node_list),
             emit(EventKind.RELAUNCH, attempt=attempt, nodes=list(table.node_list), previous=previous, reason=reason),
             Relaunch(table, attempt)]
    state, more = move(state, JobPhase.RUNNING, f"step {attempt} on {','.join(table.node_list)}")
    return state, acts + more


def _isolate(state: SupervisorState, node: str, kind: FaultKind, policy: Policy, *,
             state_override: str | None = None) -> Decision:
    """The node is excluded at once; Slurm is told in the background (off the critical path)."""
    state = dataclasses.replace(state, excluded=state.excluded | {node})
    return state, [Isolate(node, state_override or policy.isolate_state,
                           f"slurm_resilience job {state.job_id}: {kind.name.lower()}")]


def _fail_message(state: SupervisorState, cases, plan: RecoveryPlan, policy: Policy) -> str:
    lost = sorted({c.node for c in cases if is_node_fault(c.kind)})
    if lost and not state.free_spares(policy.mode):
        head = (f"node {', '.join(lost)} lost and no spare left "
                f"(spares: {', '.join(state.spare_nodes) or 'none'}): {plan.reason}")
    else:
        head = f"cannot recover: {plan.reason}"
    if policy.mode is Mode.RELAUNCH:
        return head + "; the program's own snapshots are kept"
    return head + "; add spares (--spares) or resubmit to resume from the newest checkpoint"


# -- planned changes ----------------------------------------------------------------
def on_straggler(state: SupervisorState, obs: Straggler, now: float, policy: Policy) -> Decision:
    """A straggler: logged; with ``migrate_stragglers`` and a spare, its node moves onto the spare."""
    if state.recovery is not None or obs.rank >= state.table.world_size:
        return state, []
    slot = state.table.slots[obs.rank]
    peers = sorted(obs.peers_ms)
    acts: list[Action] = [
        emit(EventKind.STRAGGLER, rank=obs.rank, node=slot.node, compute_ms=obs.compute_ms, peers_ms=peers),
        Say(f"straggler: rank {obs.rank} on {slot.node}: {obs.compute_ms:.1f} ms of compute per step, "
            f"peers {peers[len(peers) // 2] if peers else float('nan'):.1f} ms")]
    if not (policy.migrate_stragglers and state.standbys):
        return state, acts
    # a planned replacement at the next safe point: no fault, no step lost; the slow
    # rank's node moves as a whole (its G ranks) onto a spare node's standbys
    spare = next(iter(state.standbys))
    standbys = dict(state.standbys)
    warm = standbys.pop(spare)
    ranks = state.table.ranks_on(slot.node)
    moves = [Replacement(r, slot.node, spare, warm[state.table.slots[r].local_rank]) for r in ranks]
    state = dataclasses.replace(state.with_dead(*(state.table.slots[r].worker_id for r in ranks)),
                                standbys=standbys, excluded=state.excluded | {slot.node})
    state, more = node_standbys.drop(state, slot.node, kill=True)
    acts += more
    acts.append(Isolate(slot.node, "DRAIN", f"slurm_resilience job {state.job_id}: straggler"))
    table = regenerate(state.table, moves, state.addresses)
    state, more = move(state, JobPhase.RECOVERING, f"migrating straggler rank {obs.rank}")
    acts += more
    state, more = publish(state, Plan(generation=table.generation, action=PlanAction.RUN, table=table,
                                      joining=tuple(ranks), reason=f"straggler rank {obs.rank} on {slot.node}"),
                          recovery=True)
    acts += more
    state, more = begin(state, Level.STRAGGLER_MIGRATION, (), frozenset(), now, now, table.generation)
    return state, acts + more


def returning_candidates(state: SupervisorState) -> list[str]:
    """Excluded nodes of this allocation worth polling: after a scale-in, a node that is
    healthy again gets a standby and joins next."""
    if state.table.world_size >= state.target_world or state.recovery is not None:
        return []
    pool = set(state.worker_nodes) | set(state.spare_nodes)
    return sorted(n for n in state.excluded if n in pool and n not in state.returning)


def grow(state: SupervisorState, node: str, now: float, policy: Policy) -> Decision:
    """Planned scale-out at the next safe point: the standby on ``node`` becomes a rank."""
    state = dataclasses.replace(state, returning=state.returning - {node})
    if state.table.world_size >= state.target_world or state.recovery is not None:
        return state, []  # it stays a spare
    standbys = dict(state.standbys)
    wids = standbys.pop(node)
    table = grow_table(state.table, node, wids, state.addresses, device=state.device)
    state = dataclasses.replace(state, standbys=standbys)
    state, acts = move(state, JobPhase.RECOVERING, f"scaling out onto {node}")
    state, more = publish(state, Plan(generation=table.generation, action=PlanAction.RUN, table=table,
                                      joining=table.ranks_on(node),
                                      reason=f"scale out onto returned node {node}"), recovery=True)
    acts += more
    state, more = begin(state, Level.SCALE_OUT, (), frozenset(), now, now, table.generation)
    return state, acts + more


__all__ = ["on_suspects", "on_step_faults", "on_tick", "on_straggler", "grow", "returning_candidates",
           "carry_out", "begin"]
