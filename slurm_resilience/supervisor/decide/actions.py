"""Pure building blocks of decisions, shared by ``decide.py`` and ``recover.py``:
move the lifecycle, publish a plan, launch a worker, and the two job-level endings
(requeue, abort). Each returns the new state and the actions, in order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import RecoveryError
from ...lifecycle import TRANSITIONS, JobPhase
from ...protocol import EventKind, Plan, PlanAction, Role
from .messages import (
    Action, CheckSpare, DrainEvents, Exit, Launch, Phase, Publish, Reap, Requeue, Say, ShutDownStandbys, emit,
)
from .state import Mode, Policy, SupervisorState, WorkerRecord


__all__ = [
    "EXIT_OK", "EXIT_FAILED", "EXIT_REQUEUED", "Decision", "move", "publish", "launch", "launch_standbys", "requeue",
    "abort"
]


EXIT_OK, EXIT_FAILED, EXIT_REQUEUED = 0, 3, 4

Decision = tuple[SupervisorState, list[Action]]


def move(state: SupervisorState, to: JobPhase, reason: str) -> Decision:
    """A lifecycle transition, checked against ``TRANSITIONS`` (no-op if already there)."""
    if state.phase is to:
        return state, []
    if to not in TRANSITIONS[state.phase]:
        raise RecoveryError(f"illegal job phase transition {state.phase.name} -> {to.name} ({reason})")
    return dataclasses.replace(state, phase=to), [Phase(state.phase, to, reason)]


def publish(state: SupervisorState, plan: Plan, *, recovery: bool = False) -> Decision:
    """Publish ``plan`` (the store key and the pulses first, then the table files) and log it
    (the event follows the files: the recovery's ranktable phase ends when the plan was out)."""
    return dataclasses.replace(state, table=plan.table), [
        Publish(plan, recovery=recovery),
        emit(EventKind.PLAN, generation=plan.generation, action=plan.action.value,
             nodes=list(plan.table.nodes), joining=list(plan.joining), reason=plan.reason)]


def launch(state: SupervisorState, node: str, role: Role, generation: int,
           worker_id: str | None = None) -> tuple[SupervisorState, Launch]:
    """Start a worker (a new id on ``node`` unless given): its record, and the :class:`Launch` action."""
    if worker_id is None:
        state, worker_id = state.new_id(node)
    state = state.with_worker(WorkerRecord(worker_id=worker_id, node=node, role=role))
    return state, Launch(worker_id, node, role, generation)


def launch_standbys(state: SupervisorState, node: str, generation: int) -> Decision:
    """G warm standbys on ``node`` (one per local slot), added to the spare pool, and its
    health check (the node is adopted only once it passed: ``spares.py``)."""
    acts: list[Action] = []
    ids = []
    for _ in range(state.tasks_per_node):
        state, act = launch(state, node, Role.STANDBY, generation)
        ids.append(act.worker_id)
        acts.append(act)
    state = dataclasses.replace(state, standbys={**state.standbys, node: tuple(ids)},
                                spare_passed={n: t for n, t in state.spare_passed.items() if n != node},
                                checking=state.checking | {node})
    return state, acts + [CheckSpare(node)]


def requeue(state: SupervisorState, reason: str, policy: Policy, *, persist: bool) -> Decision:
    """Job level: ranks stop (after a durable checkpoint when ``persist``), then the job
    is requeued and resumes from the newest checkpoint."""
    acts: list[Action] = [Say(f"requeue: {reason}"), emit(EventKind.REQUEUE_START, reason=reason, persist=persist)]
    gen = state.table.generation + 1
    if persist:  # same ranks, a fresh group: they agree on the newest step, persist it, exit
        table = dataclasses.replace(state.table, generation=gen)
        state, more = publish(state, Plan(generation=gen, action=PlanAction.PERSIST, table=table, reason=reason))
    else:
        state, more = publish(state, Plan(generation=gen, action=PlanAction.STOP, table=state.table, reason=reason))
    acts += more + [ShutDownStandbys(), Reap(policy.fallback_timeout_s), DrainEvents(),
                    emit(EventKind.REQUEUE, reason=reason, requeue_count=state.requeue_count)]
    state, more = move(state, JobPhase.FAILED, f"requeued: {reason}")
    return state, acts + more + [Requeue(), Exit(EXIT_REQUEUED)]


def abort(state: SupervisorState, reason: str, policy: Policy, *,
          traceback: tuple[str, ...] = (), **fields: Any) -> Decision:
    """Nothing left to try: ranks persist their state and exit; the job fails (exit 3).
    ``reason`` (and a program's ``traceback``, its first lines) go to the status and the
    log; ``fields`` to the ``job_failed`` event."""
    state = dataclasses.replace(state, failure={"reason": reason, "traceback": list(traceback)})
    acts: list[Action] = []
    if policy.mode is Mode.ONLINE:
        gen = state.table.generation + 1
        state, acts = publish(state, Plan(generation=gen, action=PlanAction.ABORT, table=state.table, reason=reason))
        acts += [ShutDownStandbys(), Reap(30.0), DrainEvents()]
    else:
        acts += [Reap(0.0)]  # the all-ranks step ends now; the program's snapshots are kept
    state, more = move(state, JobPhase.FAILED, reason)
    return state, acts + more + [Say(f"  | {line}") for line in traceback] + [
        emit(EventKind.JOB_FAILED, reason=reason, **fields), Exit(EXIT_FAILED, reason)]
