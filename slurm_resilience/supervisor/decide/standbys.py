"""Pure: warm standbys on every node of the job (``recovery.local_standbys``, online mode).

A spare node's G standbys make node replacement cheap (no process start); a rank that
died on a *healthy* node used to be restarted in place by a fresh process that
imports torch cold (seconds). With local standbys every worker node also runs K
standbys of its own (the program, imported up to ``Session()``, connected, waiting for
a plan; K = ``recovery.local_standbys_per_node``, 1 by default, ``"all"`` = G, never
more than G): a plan that restarts a rank in place gives the dead rank's slot to one of
them, and new ones are started on the node once the recovery is done (off the
recovery's critical path: on a small node their imports would compete with the
recovering ranks for CPU).

Every spare node keeps K more on top of its G: when the spare takes a lost node's
ranks, its G standbys become ranks and its K extra ones are that node's own at once,
so a process restart right after (the node replacement timed out) finds every node
of the table warm, the former spare included.

    state.local_standbys: node -> its own standbys' worker ids (K at most)

``take`` (used by ``recover.carry_out`` and the process restart ``recover._relaunch_all``)
adopts one that is connected and alive, else the caller launches a process as before;
``refill`` tops every node of the table and every spare node up to K (once the job's
first step is done, a requeued start's too: ``decide._mark``, and after each recovery); ``forget`` drops one standby that died; ``drop`` forgets
all of a node's (its node was lost, isolated or left the job).
"""

from __future__ import annotations

import dataclasses

from ...protocol import EventKind, Role
from .messages import Action, Kill, emit
from .actions import Decision, launch
from .state import Policy, SupervisorState


def per_node(state: SupervisorState, policy: Policy) -> int:
    """K: how many standbys each node keeps (0: the feature is off)."""
    if not policy.local_standbys:
        return 0
    want = policy.local_standbys_per_node
    return state.tasks_per_node if want is None else min(want, state.tasks_per_node)


def take(state: SupervisorState, node: str, policy: Policy) -> tuple[SupervisorState, str | None]:
    """One of the node's standbys, removed from the pool, that can take a slot now
    (connected, alive, feature on, node not excluded); None: the caller launches a
    fresh process."""
    if not policy.local_standbys or node in state.excluded:
        return state, None
    pool = state.local_standbys.get(node, ())
    for wid in pool:
        w = state.workers.get(wid)
        if w is not None and w.connected and not w.dead:
            return _with_pool(state, node, tuple(x for x in pool if x != wid)), wid
    return state, None


def refill(state: SupervisorState, policy: Policy, generation: int) -> Decision:
    """Start standbys until every node of the table and every spare node (not
    excluded) has K."""
    want = per_node(state, policy)
    acts: list[Action] = []
    for node in dict.fromkeys((*state.table.node_list, *state.standbys)):
        if node in state.excluded:
            continue
        for _ in range(want - len(state.local_standbys.get(node, ()))):
            state, act = launch(state, node, Role.STANDBY, generation)
            state = _with_pool(state, node, (*state.local_standbys.get(node, ()), act.worker_id))
            acts += [act, emit(EventKind.LOCAL_STANDBY_STARTED, node=node, worker_id=act.worker_id,
                               generation=generation)]
    return state, acts


def forget(state: SupervisorState, worker_id: str) -> SupervisorState:
    """One standby died: it is dead and out of its node's pool (the others stay)."""
    w = state.workers.get(worker_id)
    if w is None:
        return state
    pool = state.local_standbys.get(w.node, ())
    return _with_pool(state.with_dead(worker_id), w.node, tuple(x for x in pool if x != worker_id))


def drop(state: SupervisorState, node: str, *, kill: bool) -> Decision:
    """Forget all of ``node``'s standbys (dead from now on); ``kill``: end their processes too."""
    pool = state.local_standbys.get(node, ())
    if not pool:
        return state, []
    state = _with_pool(state.with_dead(*pool), node, ())
    return state, [Kill(w) for w in pool] if kill else []


def is_local(state: SupervisorState, worker_id: str) -> bool:
    """Whether ``worker_id`` is one of its node's own warm standbys (``recovery.local_standbys``)."""
    w = state.workers.get(worker_id)
    return w is not None and worker_id in state.local_standbys.get(w.node, ())


def _with_pool(state: SupervisorState, node: str, pool: tuple[str, ...]) -> SupervisorState:
    rest = {n: x for n, x in state.local_standbys.items() if n != node}
    return dataclasses.replace(state, local_standbys={**rest, node: pool} if pool else rest)


__all__ = ["per_node", "take", "refill", "forget", "drop", "is_local"]
