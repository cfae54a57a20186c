"""What the timeline picture shows, computed from a job's event log (pure, no plotting).

* :func:`lanes`: one lane per rank (and one per warm spare) as coloured spans —
  ``starting``, ``training``, ``checkpoint`` (the stall ``save()`` cost the rank),
  ``recovering`` (fault → the recovery's first step), ``lost`` (the faulty rank: fault
  → detection) and ``standby`` (a spare waiting) — labelled with the rank's nodes.
* :func:`step_series`: steps completed over time per rank, through every event that
  carries a step (restored, first step, checkpoints, done): the pause and the
  catch-up after a fault are visible, not each step.
* :func:`recoveries`: each recovery's fault, detection, phases and first step.
* :func:`injected_fault_times`: which recovery answered which injected fault
  (``slurm-resilience inject`` records them), so the picture starts each recovery
  at its fault, not at its first sign (a silent node's first sign is its detection).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .model import FaultKind
from .protocol import EventKind, WorkerEvent


__all__ = [
    "STATES", "Lane", "Recovery", "recoveries", "RECOVERED_FAULTS", "injected_fault_times", "lanes", "step_series"
]


_NODE_FAULTS = (FaultKind.NODE_LOST.value, FaultKind.NODE_UNHEALTHY.value, FaultKind.NODE_PARTITIONED.value)
STATES = ("starting", "training", "checkpoint", "recovering", "lost", "standby")
_STEP_KINDS = {WorkerEvent.RESTORED.logged, WorkerEvent.FIRST_STEP.logged, WorkerEvent.CHECKPOINT_SAVED.logged,
               WorkerEvent.DONE.logged}


@dataclasses.dataclass(frozen=True)
class Lane:
    """One rank's row of the timeline: its states over time."""

    label: str
    spans: tuple[tuple[float, float, str], ...]  # (start, end, state), in time order


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One recovery as the timeline draws it, read from its events."""

    number: int
    level: str
    fault_at: float  # the fault's first sign the supervisor saw (``observed_at``), or as given
    injected: bool  # fault_at is the injection time given by whoever injected it
    detected: float
    first_step: float
    phases: tuple[tuple[str, float, float], ...]  # (phase, start, end)
    rank: int | None
    node: str | None
    node_fault: bool = False  # the whole node was lost (all its ranks), not one process


def recoveries(events: list[dict[str, Any]], fault_times: dict[int, float] | None = None) -> list[Recovery]:
    """``fault_times``: {recovery number: when the fault was injected}, known only to the
    injector (lab.kill_node returns it, ``inject`` records it: :func:`injected_fault_times`); otherwise the first sign the supervisor saw."""
    faults = [e for e in events if e["kind"] == EventKind.FAULT_DETECTED]
    out = []
    for d in (e for e in events if e["kind"] == EventKind.RECOVERY_DONE):
        n = d["recovery"]
        # the fault this recovery answered: the last one observed up to its detection
        f = next((e for e in reversed(faults) if e.get("observed_at", e["t"]) <= d["detected"] + 1e-6), None)
        fault = (f or {}).get("fault") or {}
        phases = tuple(sorted(((e["phase"], e["start"], e["end"]) for e in events
                               if e["kind"] == EventKind.PHASE and e["recovery"] == n), key=lambda p: p[1]))
        given = (fault_times or {}).get(n)
        seen = (f or {}).get("observed_at", d["detected"])
        out.append(Recovery(number=n, level=d["level"], fault_at=given if given is not None else min(seen, d["detected"]),
                            injected=given is not None, detected=d["detected"],
                            first_step=d["first_step"], phases=phases, rank=fault.get("rank"), node=fault.get("node"),
                            node_fault=fault.get("kind") in _NODE_FAULTS))
    return out


# the injected faults a recovery answers (the others: no recovery, or not one of the ranks)
RECOVERED_FAULTS = ("kill-rank", "kill-node", "freeze-node", "hang-rank")


def injected_fault_times(events: list[dict[str, Any]], injections: list[dict[str, Any]]) -> dict[int, float]:
    """{recovery number: when its fault was injected}: each injected fault goes to the
    first recovery detected at or after it; a recovery that answers several takes the
    earliest. Recoveries with no injection before them are left out."""
    done = sorted((e["detected"], e["recovery"]) for e in events if e["kind"] == EventKind.RECOVERY_DONE)
    out: dict[int, float] = {}
    for inj in injections:
        if inj.get("fault") not in RECOVERED_FAULTS:
            continue
        n = next((n for detected, n in done if detected >= inj["at"]), None)
        if n is not None:
            out[n] = min(out.get(n, inj["at"]), inj["at"])
    return out


def _node_at(events: list[dict[str, Any]], rank: int, t: float) -> str | None:
    """The node ``rank`` ran on at time ``t`` (the last plan published by then)."""
    plans = [p for p in events if p["kind"] == EventKind.PLAN and p["t"] <= t and rank < len(p.get("nodes", []))]
    return plans[-1]["nodes"][rank] if plans else None


def _nodes_by_rank(events: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Every node each rank ran on, in order (from the published plans)."""
    out: dict[int, list[str]] = {}
    for p in (e for e in events if e["kind"] == EventKind.PLAN):
        for r, node in enumerate(p.get("nodes", [])):
            if not out.get(r) or out[r][-1] != node:
                out.setdefault(r, []).append(node)
    return out


def _paint(base: list[tuple[float, float, str]], start: float, end: float, state: str) -> list[tuple[float, float, str]]:
    """``base`` with [start, end) painted over in ``state``."""
    if end <= start:
        return base
    out = []
    for a, b, s in base:
        if b <= start or a >= end:
            out.append((a, b, s))
            continue
        if a < start:
            out.append((a, start, s))
        if b > end:
            out.append((end, b, s))
    out.append((start, end, state))
    return sorted(out)


def lanes(events: list[dict[str, Any]], fault_times: dict[int, float] | None = None) -> list[Lane]:
    """One lane per rank, in rank order: its states from the first event to the last."""
    t0 = min(e["t"] for e in events)
    t_end = max(e["t"] for e in events)
    nodes = _nodes_by_rank(events)
    recs = recoveries(events, fault_times)
    out = []
    for r in sorted(nodes):
        mine = [e for e in events if e.get("rank") == r]
        first = next((e["t"] for e in mine if e["kind"] == WorkerEvent.FIRST_STEP.logged), None)
        done = next((e["t"] for e in reversed(mine) if e["kind"] == WorkerEvent.DONE.logged), t_end)
        spans = [(t0, first, "starting")] if first else []
        spans = spans + [(first or t0, done, "training")]
        for e in mine:
            if e["kind"] == WorkerEvent.CHECKPOINT_SAVED.logged and e.get("stall_ms"):
                spans = _paint(spans, e["t"] - e["stall_ms"] / 1000, e["t"], "checkpoint")
        for rec in recs:
            spans = _paint(spans, rec.fault_at, rec.first_step, "recovering")
            if rec.rank == r or (rec.node_fault and _node_at(events, r, rec.fault_at) == rec.node):
                spans = _paint(spans, rec.fault_at, rec.detected, "lost")
        out.append(Lane(f"rank {r}: {' → '.join(nodes[r])}", tuple(s for s in spans if s[1] > s[0])))
    start = next((e for e in events if e["kind"] == EventKind.JOB_START), None)
    for node in (start or {}).get("spares", []):
        plan = next((p for p in events if p["kind"] == EventKind.PLAN and node in p.get("nodes", [])), None)
        took = f" → rank {', '.join(str(r) for r, n in enumerate(plan['nodes']) if n == node)}" if plan else ""
        out.append(Lane(f"spare: {node}{took}", ((start["t"], plan["t"] if plan else t_end, "standby"),)))
    return out


def step_series(events: list[dict[str, Any]]) -> dict[int, list[tuple[float, int]]]:
    """Per rank, (time, steps completed) at every event that states a step, in time order."""
    out: dict[int, list[tuple[float, int]]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["kind"] in _STEP_KINDS and e.get("rank") is not None and e.get("step") is not None:
            out.setdefault(e["rank"], []).append((e["t"], int(e["step"])))
    return out
