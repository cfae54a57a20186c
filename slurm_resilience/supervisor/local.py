"""Pure: one warm standby on every worker node (``recovery.local_standbys``, online mode).

A spare node's standbys make node replacement cheap (no process start); a rank that
died on a *healthy* node used to be restarted in place by a fresh process that
imports torch cold (seconds). With local standbys every worker node also runs one
standby (the program, imported up to ``Session()``, connected, waiting for a plan),
whatever its ranks per node: the restart in place's plan gives the dead rank's slot
to that standby's worker id, and a new standby is started on the node once the
recovery is done (off the recovery's critical path: on a small node its import would
compete with the recovering ranks for CPU).

    state.local_standbys: worker node -> the one standby's worker id

``take`` (used by ``recover.carry_out``) adopts it when it is connected and alive, else
the restart in place launches a process as before; the process restart
(``recover._relaunch_all``) takes it too, for the node's first slot (it is an idle
process, not one of the possibly hung survivors that the process restart ends); ``refill`` starts the missing
ones (at the job's first start, after each recovery, and after a requeued job's
restart once its ranks have stepped: ``decide._mark``); ``drop`` forgets a node's standby
(its node was lost, isolated or left the table).
"""

from __future__ import annotations

import dataclasses

from ..protocol import EventKind, Role
from .messages import Action, Kill, emit
from .plans import launch
from .state import Policy, SupervisorState

Decision = tuple[SupervisorState, list[Action]]


def take(state: SupervisorState, node: str, policy: Policy) -> tuple[SupervisorState, str | None]:
    """The node's standby, removed from the pool, if it can take a slot now (connected,
    alive, feature on); None: the caller launches a fresh process."""
    wid = state.local_standbys.get(node)
    w = state.workers.get(wid) if wid else None
    if not policy.local_standbys or w is None or w.dead or not w.connected or node in state.excluded:
        return state, None
    left = {n: x for n, x in state.local_standbys.items() if n != node}
    return dataclasses.replace(state, local_standbys=left), wid


def refill(state: SupervisorState, policy: Policy, generation: int) -> Decision:
    """A standby on every node of the table that has none (nor is excluded)."""
    if not policy.local_standbys:
        return state, []
    acts: list[Action] = []
    for node in state.table.node_list:
        if node in state.local_standbys or node in state.excluded:
            continue
        state, act = launch(state, node, Role.STANDBY, generation)
        state = dataclasses.replace(state, local_standbys={**state.local_standbys, node: act.worker_id})
        acts += [act, emit(EventKind.LOCAL_STANDBY_STARTED, node=node, worker_id=act.worker_id,
                           generation=generation)]
    return state, acts


def drop(state: SupervisorState, node: str, *, kill: bool) -> Decision:
    """Forget ``node``'s standby (dead from now on); ``kill``: end its process too."""
    wid = state.local_standbys.get(node)
    if wid is None:
        return state, []
    state = dataclasses.replace(state.with_dead(wid),
                                local_standbys={n: x for n, x in state.local_standbys.items() if n != node})
    return state, [Kill(wid)] if kill else []


def is_local(state: SupervisorState, worker_id: str) -> bool:
    w = state.workers.get(worker_id)
    return w is not None and state.local_standbys.get(w.node) == worker_id


__all__ = ["take", "refill", "drop", "is_local"]
