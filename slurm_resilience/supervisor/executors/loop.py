"""The only loop: watch → decide → act, the same for both executors.

    executor.observe(state)  ──► observations (liveness, steps, heartbeats, node states, events)
    decide(state, obs, now)  ──► new state + actions                       (pure, decide.py)
    executor.execute(action) ──► I/O through adapters; may answer with observations
                                 (e.g. Published, with the time the plan went out)

``online.OnlineExecutor`` carries ``Session`` programs (survivors keep their
processes); ``relaunch.RelaunchExecutor`` carries unmodified programs (one
all-ranks step, relaunched). Both run the same decisions.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable, Protocol

from ..decide.decide import decide
from ..decide.messages import Action, Exit, Observation
from ..decide.state import Policy, SupervisorState


class Executor(Protocol):
    def observe(self, state: SupervisorState) -> list[Observation]:
        """What happened since the last call (blocks for at most a short poll interval)."""

    def execute(self, state: SupervisorState, action: Action) -> list[Observation]:
        """Carry out one action; ``state`` is the state after the decision."""

    def changed(self, state: SupervisorState) -> None:
        """The state changed (persist it for a re-attach)."""


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
        if new is not state:
            executor.changed(new)
        state = new
        for action in actions:
            pending.extend(executor.execute(state, action))
            if isinstance(action, Exit):
                return action.code, state
