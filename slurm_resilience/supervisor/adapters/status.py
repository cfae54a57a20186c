"""The status file: what ``slurm-resilience status`` reads, written by both executors.

Both executors (online and relaunch) write ``status.json`` through
:func:`write_status`, so ``slurm-resilience status`` reads one format.
"""

from __future__ import annotations

import enum
import json
import os
import time
from typing import Any, Mapping

from ...files import write_private
from ..decide.state import Mode, SupervisorState


__all__ = ["STATUS_FILE", "StatusMode", "status_dict", "write_status"]


STATUS_FILE = "status.json"


class StatusMode(str, enum.Enum):
    """What runs the ranks, as ``status.json``'s "mode" (and ``job_start``'s) says: ONLINE
    ``Session`` programs (``Mode.ONLINE``); TORCH or MPI an unmodified program relaunched
    as one step (``Mode.RELAUNCH``, torchrun-style or under MPI). The value is the string written."""

    ONLINE = "online"
    TORCH = "torch"
    MPI = "mpi"


def status_dict(state: SupervisorState, *, mode: StatusMode, retry_budget: int,
                endpoints: Mapping[str, Any] | None = None, steps: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The status file's content (pure but for the pid and clock). ``steps``: newer steps
    per worker than the state holds (the heartbeats'), read in place of building new records.

    Raises:
        ValueError: ``mode`` is no :class:`StatusMode` value."""
    workers, newer, mode = state.workers, steps or {}, StatusMode(mode)
    return {
        "job_id": state.job_id, "mode": mode.value, "requeue_count": state.requeue_count,
        "supervisor_pid": os.getpid(), "phase": state.phase.name, "generation": state.table.generation,
        "recoveries": state.recoveries, "relaunches": state.relaunches, "nodes": list(state.table.node_list),
        "excluded": sorted(state.excluded), "fault_retries_used": state.fault_retries_used,
        "retry_budget": retry_budget, **({"endpoints": dict(endpoints)} if endpoints else {}),
        **({"failure": dict(state.failure)} if state.failure else {}),  # reason, the program's traceback
        # a slot whose launch failed (or relaunch mode) has no worker record: pid None, step 0
        "ranks": [{"rank": s.rank, "node": s.node, "worker_id": s.worker_id,
                   "pid": getattr(workers.get(s.worker_id), "pid", None),
                   "step": newer.get(s.worker_id, getattr(workers.get(s.worker_id), "step", 0))}
                  for s in state.table.slots],
        "tasks_per_node": state.tasks_per_node,
        # one entry per warm standby (a spare node holds G of them)
        "spares": ([{"node": n, "worker_id": wid, "pid": getattr(workers.get(wid), "pid", None)}
                    for n, wids in state.standbys.items() for wid in wids] if mode is StatusMode.ONLINE else
                   [{"node": n, "worker_id": None, "pid": None} for n in state.free_spares(Mode.RELAUNCH)]),
        # recovery.local_standbys: one entry per node's own warm standby (K per node; a spare's extra ones)
        "local_standbys": [{"node": n, "worker_id": wid, "pid": getattr(workers.get(wid), "pid", None),
                            "connected": getattr(workers.get(wid), "connected", False)}
                           for n, wids in sorted(state.local_standbys.items()) for wid in wids],
        "t": time.time(),
    }


def write_status(job_dir: str, status: Mapping[str, Any]) -> None:
    """Write ``JOBDIR/status.json`` atomically and privately, not fsynced: it is rewritten often."""
    write_private(os.path.join(job_dir, STATUS_FILE), json.dumps(status), durable=False)  # twice a second
