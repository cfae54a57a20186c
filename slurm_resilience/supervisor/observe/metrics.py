"""Job metrics in the Prometheus text format, updated while the job runs.

The supervisor feeds every event it logs to :class:`Metrics` and rewrites
``JOBDIR/metrics.prom`` with the status file (a node-exporter textfile collector
can pick it up). Everything here is derived from events; rendering is pure.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from ...protocol import EventKind, WorkerEvent

__all__ = ["Metrics"]

# Worker events that carry the step a rank has reached.
_STEP_EVENTS = frozenset(w.logged for w in (WorkerEvent.FIRST_STEP, WorkerEvent.DONE,
                                            WorkerEvent.CHECKPOINT_SAVED))


class Metrics:
    """Counters derived from the job's events (``observe``), rendered as Prometheus text (``render``)."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self.started = clock()
        self.recoveries = 0
        self.recovery_seconds = 0.0  # detection → first step, summed
        self.last_phases: dict[str, float] = {}
        self.last_mttr = None
        self.lost_steps = 0
        self.ckpt = {"saved": 0, "durable": 0, "failed": 0, "stall_sum": 0.0, "stall_last": 0.0,
                     "bytes": 0, "persist_seconds": 0.0}
        self._step_at_fault: int | None = None
        self._max_step = 0

    def observe(self, ev: Mapping[str, Any]) -> None:
        """Count one logged event (the supervisor's or a rank's, as written to events.jsonl)."""
        kind = ev.get("kind")
        if kind == EventKind.PHASE:
            self.last_phases[ev["phase"]] = ev["duration_ms"] / 1000
        elif kind == EventKind.RECOVERY_START:
            self._step_at_fault = self._max_step
        elif kind == EventKind.RECOVERY_DONE:
            self.recoveries += 1
            self.last_mttr = ev["first_step"] - ev["detected"]
            self.recovery_seconds += self.last_mttr
        elif kind == WorkerEvent.RESTORED.logged and self._step_at_fault is not None and ev.get("generation"):
            self.lost_steps += max(0, self._step_at_fault - int(ev["step"]))
            self._step_at_fault = None
        elif kind in _STEP_EVENTS:
            self._max_step = max(self._max_step, int(ev.get("step", 0)))
        if kind == WorkerEvent.CHECKPOINT_SAVED.logged and ev.get("rank") == 0:
            self.ckpt["saved"] += 1
            self.ckpt["stall_last"] = ev["stall_ms"] / 1000
            self.ckpt["stall_sum"] += ev["stall_ms"] / 1000
        elif kind == WorkerEvent.CHECKPOINT_DURABLE.logged and ev.get("rank") == 0:
            self.ckpt["durable"] += 1
            self.ckpt["bytes"] += int(ev.get("bytes", 0))
            self.ckpt["persist_seconds"] += float(ev.get("seconds", 0.0))
        elif kind == WorkerEvent.CHECKPOINT_FAILED.logged and ev.get("rank") == 0:
            self.ckpt["failed"] += 1

    def render(self, status: Mapping[str, Any]) -> str:
        """Pure given the accumulated counters and a status snapshot."""
        wall = max(self._clock() - self.started, 1e-9)
        lost = self.recovery_seconds + self.ckpt["stall_sum"]
        steps = [r["step"] for r in status.get("ranks", [])]
        rows = [
            ("sr_generation", "gauge", "current generation", [({}, status.get("generation", 0))]),
            ("sr_world_size", "gauge", "ranks in the current generation", [({}, len(steps))]),
            ("sr_spares_available", "gauge", "warm standbys left", [({}, len(status.get("spares", [])))]),
            ("sr_step", "gauge", "slowest rank's completed steps", [({}, min(steps) if steps else 0)]),
            ("sr_recoveries_total", "counter", "recoveries completed", [({}, self.recoveries)]),
            ("sr_mttr_seconds", "gauge", "last recovery: detection to first step",
             [({}, self.last_mttr if self.last_mttr is not None else float("nan"))]),
            ("sr_recovery_phase_seconds", "gauge", "last recovery, per phase",
             [({"phase": p}, v) for p, v in self.last_phases.items()]),
            ("sr_lost_steps_total", "counter", "steps redone after recoveries", [({}, self.lost_steps)]),
            ("sr_checkpoint_stall_seconds", "gauge", "last checkpoint's training stall (rank 0)",
             [({}, self.ckpt["stall_last"])]),
            ("sr_checkpoints_total", "counter", "checkpoints by outcome (rank 0)",
             [({"outcome": k}, self.ckpt[k]) for k in ("saved", "durable", "failed")]),
            ("sr_checkpoint_persist_bytes_per_second", "gauge", "background persist throughput (rank 0)",
             [({}, self.ckpt["bytes"] / self.ckpt["persist_seconds"] if self.ckpt["persist_seconds"] else 0.0)]),
            ("sr_effective_training_time_ratio", "gauge",
             "1 - (recovery + checkpoint stall time) / wall time", [({}, max(0.0, 1 - lost / wall))]),
        ]
        out = []
        for name, typ, help_, samples in rows:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {typ}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")
        return "\n".join(out) + "\n"
