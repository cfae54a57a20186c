"""The executor contract: what an executor is, and which actions it carries out.

Both executors (``online.Supervisor``, ``relaunch.RelaunchExecutor``) declare the
action types they handle in ``HANDLES``; the loop hands an action over only through
:func:`carry_out`, which refuses any other type with :class:`UnhandledActionError`
(``decide`` produced an action this executor cannot do: a bug, never silently
dropped). ``tests/unit/test_executor_contract.py`` runs both over every ``Action``.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from ...errors import ResilienceError
from ..decide.messages import Action, Observation
from ..decide.state import SupervisorState


__all__ = ["UnhandledActionError", "Executor", "carry_out"]


class UnhandledActionError(ResilienceError):
    """An executor was given an action type it does not carry out."""


class Executor(Protocol):
    """Carries out ``decide``'s actions and reports what happened; one per mode (online, relaunch)."""

    HANDLES: ClassVar[frozenset[type]]
    """The action types this executor carries out; any other is an UnhandledActionError."""

    def observe(self, state: SupervisorState) -> list[Observation]:
        """What happened since the last call (blocks for at most a short poll interval)."""

    def execute(self, state: SupervisorState, action: Action) -> list[Observation]:
        """Carry out one action; ``state`` is the state after the decision."""

    def changed(self, state: SupervisorState) -> None:
        """The state changed (persist it for a re-attach)."""


def carry_out(executor: Executor, state: SupervisorState, action: Action) -> list[Observation]:
    """``executor.execute(state, action)`` when the executor handles the action's type.

    Raises:
        UnhandledActionError: ``type(action)`` is not in ``executor.HANDLES``.
    """
    if type(action) not in executor.HANDLES:
        raise UnhandledActionError(f"{type(executor).__name__} does not carry out {type(action).__name__} "
                                   f"(it handles {', '.join(sorted(t.__name__ for t in executor.HANDLES))})")
    return executor.execute(state, action)
