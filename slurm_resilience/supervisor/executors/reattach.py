"""Re-attach: a restarted supervisor takes over the running workers without restarting them.

The supervisor keeps its :class:`~.state.SupervisorState` in ``JOBDIR/supervisor.json``
(written privately and atomically whenever it changes and with every status update),
with how far it has read the workers' events. A restarted supervisor (``--reattach``)
loads it (:func:`load`), connects to the store the batch step still hosts
(``keeper.py``), opens a new liveness socket whose port it publishes in the store
(the workers reconnect to it), adopts any plan published after the state was last
written (:func:`adopt_plans`, pure), and carries on watching.

What is lost with a killed supervisor: the bookkeeping of a recovery that was in
flight (its phase marks and deadline). Its plan is in the store, so the ranks finish
it; a rank that never comes up is caught as a stale heartbeat.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Iterable

from ...errors import ResilienceError
from ...files import write_private
from ...protocol import Plan, PlanAction, Role
from ..decide.state import SupervisorState, WorkerRecord


__all__ = ["STATE_FILE", "STATE_VERSION", "save", "load", "adopt_plans"]


STATE_FILE = "supervisor.json"
STATE_VERSION = 2


def save(job_dir: str, state: SupervisorState, events_seen: int) -> None:
    """Atomic, not fsynced: written at every decision, on a recovery's critical path (before
    its plan goes out); only the supervisor restarted on this same host reads it back, after
    a process crash the page cache survives (a lost batch host ends the job's supervision)."""
    write_private(os.path.join(job_dir, STATE_FILE), json.dumps(
        {"version": STATE_VERSION, "t": time.time(), "events_seen": events_seen, "state": state.to_dict()}),
        durable=False)


def load(job_dir: str) -> tuple[SupervisorState, int, float]:
    """(state, events already read, when it was written).

    Raises:
        ResilienceError: (one line) nothing to re-attach to, or an unreadable file.
    """
    path = os.path.join(job_dir, STATE_FILE)
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ResilienceError(f"no supervisor state in {job_dir} ({STATE_FILE} missing): "
                              "nothing to re-attach to; start the job without --reattach") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ResilienceError(f"cannot read {path}: {exc}") from None
    if not isinstance(d, dict) or d.get("version") != STATE_VERSION:
        raise ResilienceError(f"{path} has version {d.get('version') if isinstance(d, dict) else None!r}, "
                              f"expected {STATE_VERSION}")
    try:
        return SupervisorState.from_dict(d["state"]), int(d["events_seen"]), float(d["t"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ResilienceError(f"{path} is not a supervisor state: {exc!r}") from None


def adopt_plans(state: SupervisorState, plans: Iterable[Plan]) -> SupervisorState:
    """Pure: plans published after the state was written (in generation order, from
    ``state.table.generation + 1``): the ranks follow them, so the state does too."""
    for plan in plans:
        if plan.generation != state.table.generation + 1 or plan.action not in (PlanAction.RUN, PlanAction.PERSIST):
            break
        workers = dict(state.workers)
        for slot in plan.table.slots:
            workers.setdefault(slot.worker_id, WorkerRecord(worker_id=slot.worker_id, node=slot.node,
                                                            role=Role.RANK, connected=True))
        taken = {s.worker_id for s in plan.table.slots}
        state = dataclasses.replace(state, table=plan.table, workers=workers,
                                    standbys={n: w for n, w in state.standbys.items() if not set(w) & taken},
                                    local_standbys={n: left for n, w in state.local_standbys.items()
                                                    if (left := tuple(x for x in w if x not in taken))})
    return state
