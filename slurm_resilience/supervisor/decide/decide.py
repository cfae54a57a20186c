"""Pure: the supervisor's every decision, ``decide(state, observation, now, policy)``.

    observation ──► decide ──► (new SupervisorState, [Action])
                      │
                      ├─ Start            launch generation 0 (+ standbys)
                      ├─ Suspects/...     classify → ladder → plan (recover.py)
                      ├─ Published        a recovery's plan is out: its deadline starts
                      ├─ WorkerMark(s)    recovery phases; the last rank's first step ends it
                      ├─ StepTrained      relaunch mode: the relaunched step's first step ends it
                      ├─ Tick             a recovery past its deadline falls back (ladder, failed set)
                      ├─ AllDone          finish
                      ├─ Preempted        persist at one step, requeue
                      ├─ NodeBack         scale back out (standbys and a health check first)
                      ├─ SpareChecked     healthy spares only (spares.py)
                      ├─ Straggler        report; migrate to a spare if configured
                      └─ LivenessChange   the watchdog's suspects and slow ranks: report only

No I/O and no clock (``now`` is given): executors (``online.py`` for ``Session``
programs, ``relaunch.py`` for unmodified ones) gather observations and carry the
actions out. The shape is torch elastic's rendezvous: a pure op returns an action,
an executor does the I/O.
"""

from __future__ import annotations

import dataclasses

from ...lifecycle import JobPhase
from ...model import Fault, FaultKind
from ...protocol import EventKind, Plan, PlanAction, Role, WorkerEvent
from . import recover, relaunch_recovery, spares, standbys
from .messages import (
    Action, AllDone, Connected, DrainEvents, Exit, Isolate, Kill, NodeBack, Observation, Preempted, Published, Reap,
    LivenessChange, Relaunch, Say, ShutDownStandbys, SpareChecked, Start, StepFaults, StepTrained, Straggler, Suspects,
    Tick, Verdict, WorkerMark, WorkerMarks, emit,
)
from .actions import EXIT_FAILED, EXIT_OK, EXIT_REQUEUED, Decision, launch, launch_standbys, move, publish, requeue
from .ranktable import initial_table
from .ladder import Level
from .report import Mark, recovery_phases
from .state import Mode, Policy, Recovery, SupervisorState

__all__ = ["decide", "EXIT_OK", "EXIT_FAILED", "EXIT_REQUEUED"]


def decide(state: SupervisorState, obs: Observation, now: float, policy: Policy) -> Decision:
    """The new state and the actions that carry the change out, in order."""
    if isinstance(obs, Start):
        return _start(state, obs, policy)
    if isinstance(obs, Connected):
        return _connected(state, obs, now, policy)
    if isinstance(obs, Suspects):
        return recover.on_suspects(state, obs, now, policy)
    if isinstance(obs, StepFaults):
        return recover.on_step_faults(state, obs, now, policy)
    if isinstance(obs, Published):
        if policy.mode is Mode.RELAUNCH:  # the relaunched step started (relaunch_recovery.py)
            return relaunch_recovery.on_relaunched(state, obs)
        return _published(state, obs, policy)
    if isinstance(obs, StepTrained):
        return relaunch_recovery.on_step_trained(state, obs)
    if isinstance(obs, WorkerMarks):
        return _marks(state, obs.marks, policy)
    if isinstance(obs, WorkerMark):
        return _marks(state, (obs,), policy)
    if isinstance(obs, Tick):
        state, acts = spares.recheck_due(state, now, policy)
        state, more = recover.on_tick(state, now, policy)
        return state, acts + more
    if isinstance(obs, SpareChecked):
        return _spare_checked(state, obs, now, policy)
    if isinstance(obs, AllDone):
        if policy.mode is Mode.RELAUNCH:  # a relaunch that never reported a step ends with the job
            state, acts = relaunch_recovery.unfinished(state, "the relaunched step ended")
            state, more = _finish(state, policy)
            return state, acts + more
        return _finish(state, policy)
    if isinstance(obs, Preempted):
        return requeue(state, f"preempted ({obs.signal or 'the preemption signal'} before the time limit "
                              "or by the scheduler)", policy, persist=True)
    if isinstance(obs, NodeBack):
        return _node_back(state, obs, policy)
    if isinstance(obs, Straggler):
        return recover.on_straggler(state, obs, now, policy)
    if isinstance(obs, LivenessChange):
        return _liveness(state, obs)
    raise TypeError(f"not an observation: {obs!r}")


# -- handlers -------------------------------------------------------------------
def _start(state: SupervisorState, obs: Start, policy: Policy) -> Decision:
    ids = []
    for node in state.worker_nodes:
        for _ in range(state.tasks_per_node):
            state, wid = state.new_id(node)
            ids.append(wid)
    table = initial_table(list(state.worker_nodes), ids, state.addresses, device=state.device,
                          tasks_per_node=state.tasks_per_node)
    state, published = publish(state, Plan(generation=0, action=PlanAction.RUN, table=table,
                                           joining=tuple(range(table.world_size)), reason="start"))
    acts: list[Action] = []
    if policy.mode is Mode.RELAUNCH:
        published = []
        acts = [Relaunch(table, attempt=0)]  # no store: the program rendezvous by itself
    else:
        for slot in table.slots:
            state, act = launch(state, slot.node, Role.RANK, 0, slot.worker_id)
            acts.append(act)
        for node in state.spare_nodes:
            state, more = launch_standbys(state, node, 0)
            acts += more
        # the worker nodes' own standbys wait for the job's first step (``_mark``): started
        # now, their imports would double the CPU and file-system load of the ranks' start
    # The plan goes out after every launch and the job_start event (its time: all steps
    # launched): a worker's start (srun, import torch) is the long part of a (re)start and
    # it polls for plan/0 by itself, so the supervisor launches before its store client
    # (import torch) is up (online.py, StoreLink) and the two starts overlap.
    acts += [Say(f"job started: {table.world_size} ranks on {','.join(state.worker_nodes)} "
                 f"({state.tasks_per_node} per node); spares {','.join(state.spare_nodes) or 'none'}"),
             emit(EventKind.JOB_START, ranks=list(state.worker_nodes), spares=list(state.spare_nodes),
                  tasks_per_node=state.tasks_per_node, **dict(obs.info)), *published]
    state, more = move(state, JobPhase.RUNNING, "all ranks launched")
    return state, acts + more


def _connected(state: SupervisorState, obs: Connected, now: float, policy: Policy) -> Decision:
    w = state.workers.get(obs.worker_id)
    if w is None:
        return state, []
    state = state.with_worker(dataclasses.replace(w, connected=True, pid=obs.pid))
    pool = state.standbys.get(w.node, ())
    if (w.node in state.returning and w.worker_id in pool and w.node in state.spare_passed
            and all(state.workers[x].connected for x in pool)):
        return recover.grow(state, w.node, now, policy)  # its G standbys are up and its check passed
    return state, []


def _published(state: SupervisorState, obs: Published, policy: Policy) -> Decision:
    rec = state.recovery
    if rec is None or rec.generation != obs.generation:
        return state, []
    timeout = policy.fallback_timeout_s if rec.level is Level.PROCESS_RESTART else policy.online_timeout_s
    first = Mark.PUBLISHED not in rec.marks
    rec = dataclasses.replace(rec, marks={**rec.marks, Mark.PUBLISHED: obs.t}, deadline=obs.t + timeout)
    acts: list[Action] = []
    if first and rec.level is not Level.PROCESS_RESTART:
        acts.append(Say(f"recovery {rec.number}: {rec.level}, generation {rec.generation} published "
                        f"{(obs.t - rec.marks[Mark.DETECTED]) * 1000:.1f} ms after detection"))
    return dataclasses.replace(state, recovery=rec), acts


_MARKS = {WorkerEvent.RECONNECTED: Mark.RECONNECTED, WorkerEvent.RESTORED: Mark.RESTORED,
          WorkerEvent.FIRST_STEP: Mark.FIRST_STEP, WorkerEvent.DONE: Mark.FIRST_STEP}


def _marks(state: SupervisorState, marks: tuple[WorkerMark, ...], policy: Policy) -> Decision:
    """Fold a poll's marks in order: each rank's first mark of a kind counts, and the last
    rank's first step ends the recovery; with none in flight, the job's training in the
    current generation starts the nodes' own standbys. One copy of the marks per batch."""
    acts: list[Action] = []
    i = 0
    while i < len(marks):
        rec = state.recovery
        if rec is None:
            if any(m.kind is WorkerEvent.FIRST_STEP and m.generation == state.table.generation for m in marks[i:]):
                state, more = standbys.refill(state, policy, state.table.generation)  # the job trains
                acts += more
            return state, acts
        got = {key: dict(ranks) for key, ranks in rec.worker_marks.items()}
        done = False
        while i < len(marks) and not done:
            m = marks[i]
            i += 1
            if m.generation == rec.generation and m.kind in _MARKS:
                got.setdefault(_MARKS[m.kind], {}).setdefault(m.rank, m.t)
                done = (Mark.PUBLISHED in rec.marks
                        and len(got.get(Mark.FIRST_STEP, {})) >= state.table.world_size)
        rec = dataclasses.replace(rec, worker_marks=got)
        state = dataclasses.replace(state, recovery=rec)
        if done:
            state, more = _recovered(state, rec, policy)
            acts += more
    return state, acts


def _recovered(state: SupervisorState, rec: Recovery, policy: Policy) -> Decision:
    """The last rank trained a step: log the phases, end the recovery, refill the standbys."""
    acts: list[Action] = [emit(EventKind.PHASE, recovery=rec.number, phase=phase, start=start, end=end,
                               duration_ms=round((end - start) * 1000, 3))
                          for phase, start, end in recovery_phases(rec.marks, rec.worker_marks)]
    last = max(rec.worker_marks[Mark.FIRST_STEP].values())
    total = last - rec.marks[Mark.DETECTED]
    acts += [emit(EventKind.RECOVERY_DONE, t=last, recovery=rec.number, level=rec.level,
                  generation=rec.generation, detected=rec.marks[Mark.DETECTED], first_step=last,
                  detect_to_step_s=total),
             Say(f"recovery {rec.number} done: generation {rec.generation} trained a step "
                 f"{total * 1000:.0f} ms after detection")]
    state = dataclasses.replace(state, recovery=None)
    state, more = move(state, JobPhase.RUNNING, f"recovery {rec.number} done")
    acts += more
    state, more = standbys.refill(state, policy, rec.generation)  # off the critical path: it is done
    return state, acts + more


def _finish(state: SupervisorState, policy: Policy) -> Decision:
    if state.recovery is not None:
        return state, []  # the last ranks' marks close it first
    state, acts = move(state, JobPhase.FINISHING, "every rank finished")
    if policy.mode is Mode.ONLINE:
        acts += [ShutDownStandbys(), Reap(30.0, end_unready=True), DrainEvents()]
    state, more = move(state, JobPhase.SUCCEEDED, "every rank finished")
    n = state.recoveries
    done = (emit(EventKind.JOB_DONE, recoveries=n, generation=state.table.generation) if policy.mode is Mode.ONLINE
            else emit(EventKind.JOB_DONE, relaunches=state.relaunches, nodes=list(state.table.node_list)))
    return state, acts + more + [done, Say(f"job finished after {n} recover{'y' if n == 1 else 'ies'}"),
                                 Exit(EXIT_OK)]


def _node_back(state: SupervisorState, obs: NodeBack, policy: Policy) -> Decision:
    if obs.node not in recover.returning_candidates(state):
        return state, []
    state = dataclasses.replace(state, excluded=state.excluded - {obs.node}, returning=state.returning | {obs.node})
    state, acts = launch_standbys(state, obs.node, state.table.generation)
    state, more = standbys.refill(state, policy, state.table.generation)  # its own K, like every spare's
    acts += more
    return state, acts + [emit(EventKind.NODE_RETURNED, node=obs.node, state=obs.state),
                          Say(f"node {obs.node} is back in service ({obs.state}): starting "
                              f"{state.tasks_per_node} standby(s) to scale out")]


def _spare_checked(state: SupervisorState, obs: SpareChecked, now: float, policy: Policy) -> Decision:
    state = dataclasses.replace(state, checking=state.checking - {obs.node})
    if obs.reason is None:
        state = dataclasses.replace(state, spare_passed={**state.spare_passed, obs.node: obs.t})
        acts: list[Action] = [emit(EventKind.SPARE_CHECKED, node=obs.node, duration_s=round(obs.duration_s, 3))]
        pool = state.standbys.get(obs.node, ())
        if obs.node in state.returning and pool and all(state.workers[w].connected for w in pool):
            state, more = recover.grow(state, obs.node, now, policy)
            acts += more
        return state, acts
    acts = [emit(EventKind.SPARE_CHECK_FAILED, node=obs.node, reason=obs.reason),
            Say(f"spare {obs.node} failed its health check: {obs.reason}; not adopted")]
    passed = {n: t for n, t in state.spare_passed.items() if n != obs.node}
    pool = state.standbys.get(obs.node, ())
    state = dataclasses.replace(state.with_dead(*pool), spare_passed=passed,
                                standbys={n: w for n, w in state.standbys.items() if n != obs.node},
                                returning=state.returning - {obs.node})
    acts += [Kill(w) for w in pool]
    state, more = standbys.drop(state, obs.node, kill=True)  # a spare's extra standbys (or, adopted, its own)
    acts += more
    ranks = state.table.ranks_on(obs.node)
    if ranks:  # adopted before a stale re-check came back: its ranks move on
        fault = Fault(kind=FaultKind.NODE_UNHEALTHY, rank=ranks[0], node=obs.node, time=now,
                      detail=f"health check failed after adoption: {obs.reason}")
        state = state.with_dead(*(state.table.slots[r].worker_id for r in ranks))
        state, more = recover.incident(state, [fault], obs.t, now, policy, isolate_state="DRAIN")
        return state, acts + more
    if obs.node not in state.excluded:
        state = dataclasses.replace(state, excluded=state.excluded | {obs.node})
        acts.append(Isolate(obs.node, "DRAIN", f"slurm_resilience job {state.job_id}: health check: {obs.reason}"))
    return state, acts


_LIVENESS_EVENTS = {Verdict.SUSPECT: EventKind.SUSPECT, Verdict.SLOW: EventKind.PROGRESS_SLOW,
                    Verdict.OK: EventKind.SUSPECT_CLEARED}


def _liveness(state: SupervisorState, obs: LivenessChange) -> Decision:
    """A suspect is an event and a line, never a recovery (the watchdog confirms hangs)."""
    kind = _LIVENESS_EVENTS.get(obs.new)
    if (kind is None or not state.watched(obs.worker_id)
            or (obs.new is Verdict.OK and obs.old is Verdict.WAITING)):
        return state, []
    slot = state.slot_of(obs.worker_id)
    who = f"rank {slot.rank}" if slot else f"worker {obs.worker_id}"
    fields = dict(worker_id=obs.worker_id, rank=slot.rank if slot else None, node=state.workers[obs.worker_id].node,
                  t=obs.t, previous=obs.old.value)
    if kind is EventKind.SUSPECT_CLEARED:
        return state, [emit(kind, **fields), Say(f"{who} is well again (was {obs.old.value})")]
    return state, [emit(kind, evidence=obs.evidence, **fields), Say(f"{who} {obs.new.value}: {obs.evidence}")]
