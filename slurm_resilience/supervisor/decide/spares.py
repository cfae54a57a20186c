"""Pure: healthy spares only (the checks' timing; their results are handled in ``decide``). A spare node is adopted only after its health check
(``health.py``, run there as a step) passed; the check runs when its standbys start,
again when the last pass is older than ``recovery.spare_check_max_age_s`` (on a
``Tick``), and at adoption if it is that old — then in parallel with the recovery,
never on its critical path. A spare that fails is drained with the check's reason,
its standbys are ended and the next spare is taken; a node that failed after it was
adopted is a node fault like any other (its ranks move on).
"""

from __future__ import annotations

import dataclasses

from .messages import Action, CheckSpare
from .actions import Decision
from .state import Policy, SupervisorState


__all__ = ["check", "stale", "recheck_due"]


def check(state: SupervisorState, node: str) -> Decision:
    """Start a check on ``node`` unless one is in flight."""
    if node in state.checking:
        return state, []
    return dataclasses.replace(state, checking=state.checking | {node}), [CheckSpare(node)]


def stale(state: SupervisorState, node: str, now: float, policy: Policy) -> bool:
    """Whether ``node``'s spare check never passed or is older than ``recovery.spare_check_max_age_s``."""
    passed = state.spare_passed.get(node)
    return passed is None or now - passed > policy.spare_check_max_age_s


def recheck_due(state: SupervisorState, now: float, policy: Policy) -> Decision:
    """Spares whose last pass is too old are checked again (never two at once per node)."""
    acts: list[Action] = []
    for node in state.standbys:
        if node not in state.excluded and node in state.spare_passed and stale(state, node, now, policy):
            state, more = check(state, node)
            acts += more
    return state, acts
