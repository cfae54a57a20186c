"""Re-attach: a restarted supervisor takes over the running workers without restarting them.

The supervisor keeps its state in ``JOBDIR/supervisor.json`` (written privately,
atomically, whenever it changes and with every status update): the rank table and
generation, the workers it started (step names, pids), the spare pool, excluded
and returning nodes, retry budgets, recovery count and how far it has read the
workers' events. A restarted supervisor (``--reattach``) reloads it, connects to
the store the batch step still hosts (``keeper.py``), opens a new liveness socket
whose port it publishes in the store (the workers reconnect to it), adopts any plan
published after the state was last written, and carries on watching.

What is lost with a killed supervisor: the bookkeeping of a recovery that was in
flight (its phase marks and deadline). Its plan is in the store, so the ranks finish
it; a rank that never comes up is caught as a stale heartbeat.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..errors import ResilienceError
from ..files import write_private
from ..lifecycle import JobPhase, Lifecycle
from ..model import RankTable
from ..protocol import EVENT_COUNTER, Plan, PlanAction, event_key, plan_key

STATE_FILE = "supervisor.json"
STATE_VERSION = 1


def snapshot(sup: Any) -> dict[str, Any]:
    """What a restarted supervisor needs (pure: reads the supervisor's fields)."""
    return {
        "version": STATE_VERSION, "job_id": sup.job_id, "t": time.time(),
        "phase": sup.lifecycle.phase.name, "table": sup.table.to_dict(),
        "target_world": sup.target_world, "worker_nodes": list(sup.worker_nodes),
        "spare_nodes": list(sup.spare_nodes), "standbys": dict(sup.standbys),
        "excluded": sorted(sup.excluded), "returning": sorted(sup.returning),
        "restarts": {str(r): n for r, n in sup.restarts.items()}, "recoveries": sup.recoveries,
        "ids": sup._ids, "ev_seen": sup._ev_seen,
        "workers": [{"worker_id": w.worker_id, "node": w.node, "name": w.handle.name,
                     "pid": getattr(w.handle, "pid", None) or w.pid, "dead": w.dead}
                    for w in sup.workers.values()],
    }


def save(sup: Any) -> None:
    write_private(os.path.join(sup.job_dir, STATE_FILE), json.dumps(snapshot(sup)))


def load(job_dir: str) -> dict[str, Any]:
    """Raises ResilienceError (one line) when there is nothing to re-attach to."""
    path = os.path.join(job_dir, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise ResilienceError(f"no supervisor state in {job_dir} ({STATE_FILE} missing): "
                              "nothing to re-attach to; start the job without --reattach") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ResilienceError(f"cannot read {path}: {exc}") from None
    if state.get("version") != STATE_VERSION:
        raise ResilienceError(f"{path} has version {state.get('version')!r}, expected {STATE_VERSION}")
    return state


def reattach(sup: Any, state: dict[str, Any]) -> list[str]:
    """Restore ``sup`` from ``state`` and the store; returns the worker ids taken over."""
    from .loop import Worker

    sup.table = RankTable.from_dict(state["table"])
    sup.target_world = int(state["target_world"])
    sup.worker_nodes, sup.spare_nodes = list(state["worker_nodes"]), list(state["spare_nodes"])
    sup.standbys = dict(state["standbys"])
    sup.excluded, sup.returning = set(state["excluded"]), set(state["returning"])
    sup.restarts = {int(r): int(n) for r, n in state["restarts"].items()}
    sup.recoveries, sup._ids, sup._ev_seen = int(state["recoveries"]), int(state["ids"]), int(state["ev_seen"])
    phase = JobPhase[state["phase"]]
    sup.lifecycle = Lifecycle(JobPhase.RUNNING if phase in (JobPhase.RECOVERING, JobPhase.FALLBACK_RELAUNCH,
                                                            JobPhase.STARTING) else phase)
    now = time.time()
    for rec in state["workers"]:
        handle = sup.launcher.attach(name=rec["name"], node=rec["node"], pid=rec["pid"])
        sup.workers[rec["worker_id"]] = Worker(worker_id=rec["worker_id"], node=rec["node"], handle=handle,
                                               connected_at=now, pid=rec["pid"], dead=bool(rec["dead"]))
    _adopt_newer_plans(sup, now)
    _skip_consumed_events(sup)
    return [w for w, rec in sup.workers.items() if not rec.dead]


def _adopt_newer_plans(sup: Any, now: float) -> None:
    """Plans published after the state was written: the ranks follow them, so do we."""
    from .loop import Worker

    while sup.store.check([plan_key(sup.table.generation + 1)]):
        plan = Plan.from_json(sup.store.get(plan_key(sup.table.generation + 1)))
        if plan.action not in (PlanAction.RUN, PlanAction.PERSIST):
            break
        sup.table = plan.table
        for slot in plan.table.slots:
            if slot.worker_id not in sup.workers:
                handle = sup.launcher.attach(name=f"sr-{slot.worker_id}", node=slot.node, pid=None)
                sup.workers[slot.worker_id] = Worker(worker_id=slot.worker_id, node=slot.node,
                                                     handle=handle, connected_at=now)
            sup.standbys = {n: w for n, w in sup.standbys.items() if w != slot.worker_id}


def _skip_consumed_events(sup: Any) -> None:
    """Events the old supervisor had read (and deleted) after its last state write."""
    n = sup.store.add(EVENT_COUNTER, 0)
    while sup._ev_seen < n and not sup.store.check([event_key(sup._ev_seen + 1)]):
        sup._ev_seen += 1
