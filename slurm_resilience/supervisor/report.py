"""What the supervisor reports: recovery phases (pure) and the status file.

Phases of one recovery, from the supervisor's marks and the ranks' events::

    detected ─classify─ classified ─replace─ replaced ─ranktable─ published
        ─reconnect─ last rank joined ─restore─ last rank restored ─first_step─ last rank stepped
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping

from ..model import Fault


@dataclasses.dataclass
class Recovery:
    """One recovery in flight: its marks (unix times) become the timeline's phases."""

    number: int
    generation: int
    level: str
    faults: list[Fault]
    marks: dict[str, float]
    deadline: float
    worker_marks: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)


def recovery_phases(rec: Recovery) -> list[tuple[str, float, float]]:
    """Pure: (phase, start, end) for a finished recovery; the last rank sets each end."""
    last = {k: max(v.values()) for k, v in rec.worker_marks.items()}
    m = rec.marks
    joined = last.get("reconnected", m["published"])
    restored = last.get("restored", joined)
    return [("classify", m["detected"], m["classified"]),
            ("replace", m["classified"], m["replaced"]),
            ("ranktable", m["replaced"], m["published"]),
            ("reconnect", m["published"], joined),
            ("restore", joined, restored),
            ("first_step", restored, last["first_step"])]


def status_dict(sup: Any, workers: Mapping[str, Any]) -> dict[str, Any]:
    """The status file's content (``slurm-resilience status`` reads it)."""
    return {
        "job_id": sup.job_id, "restart_count": sup.restart_count, "supervisor_pid": os.getpid(),
        "phase": sup.lifecycle.phase.name, "generation": sup.table.generation,
        "recoveries": sup.recoveries, "excluded": sorted(sup.excluded),
        "restarts": {str(r): n for r, n in sup.restarts.items()},
        "retry_budget": sup.cfg.recovery.fault_retry_times,
        "endpoints": {"host": sup.store_host, "store_port": sup._raw_store.port,
                      "liveness_port": sup.liveness.port, "rejected_connections": sup.liveness.rejected},
        # a slot whose launch failed has no worker record: pid None, step 0
        "ranks": [{"rank": s.rank, "node": s.node, "worker_id": s.worker_id,
                   "pid": getattr(workers.get(s.worker_id), "pid", None),
                   "step": getattr(workers.get(s.worker_id), "step", 0)}
                  for s in sup.table.slots],
        "spares": [{"node": n, "worker_id": wid, "pid": getattr(workers.get(wid), "pid", None)}
                   for n, wid in sup.standbys.items()],
        "t": time.time(),
    }
