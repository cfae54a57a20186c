"""The only loop: watch → decide → act, the same for both executors.

    executor.observe(state)  ──► observations (liveness, steps, heartbeats, node states, events)
    decide(state, obs, now)  ──► new state + actions                       (pure, decide.py)
    carry_out(executor, action) ──► I/O through adapters; may answer with observations
                                 (e.g. Published, with the time the plan went out)

``online.Supervisor`` carries ``Session`` programs (survivors keep their
processes); ``relaunch.RelaunchExecutor`` carries unmodified programs (one
all-ranks step, relaunched). Both run the same decisions.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable

from ..decide.decide import decide
from ..decide.messages import Exit, Observation, Publish
from ..decide.state import Policy, SupervisorState
from .contract import Executor, carry_out


__all__ = ["run"]


def run(executor: Executor, state: SupervisorState, policy: Policy, first: Iterable[Observation] = (),
        clock: Callable[[], float] = time.time) -> tuple[int, SupervisorState]:
    """Until a decision says Exit: returns (exit code, final state)."""
    pending = collections.deque(first)
    while True:
        if not pending:
            pending.extend(executor.observe(state))
            if not pending:
                continue
        new, actions = decide(state, pending.popleft(), clock(), policy)
        # Persisted before its actions, except a decision that publishes a plan: that save
        # (O(N)) would delay the recovery, and a re-attach adopts a plan newer than it.
        after = new is not state and any(isinstance(a, Publish) for a in actions)
        if new is not state and not after:
            executor.changed(new)
        state = new
        for action in actions:
            pending.extend(carry_out(executor, state, action))
            if isinstance(action, Exit):
                if after:
                    executor.changed(state)
                return action.code, state
        if after:
            executor.changed(state)
