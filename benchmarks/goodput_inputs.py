"""benchmarks/goodput.py's inputs, read from what the other benchmarks measured.

* ``mttr.json`` (benchmarks/mttr.py): the online phases from the kill-node case's
  medians (detect = fault → detection; the rest from its ``phase`` events); the
  process-fault and hang downtimes from the kill-rank and hang-rank medians; the
  silent-loss downtime from the freeze-node case when it was run.
* ``checkpoint.json`` (benchmarks/checkpoint.py): the toolkit's blocking checkpoint
  cost (its training stall) and the baseline's synchronous write (torch.save to
  durable), both scaled linearly from the benchmark's state size to the modelled
  state per rank.

Pure: each function maps a parsed JSON document to numbers (unit-tested).
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

PHASES = ("classify", "replace", "ranktable", "reconnect", "restore", "first_step")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _runs(doc: Mapping[str, Any], case: str) -> list[dict]:
    return [r for r in doc.get("results", {}).get(case, {}).get("runs", []) if r.get("mttr_s") is not None]


def phases_ms(doc: Mapping[str, Any], case: str = "kill-node") -> dict[str, float]:
    """``{phase: ms}`` medians of ``case``'s runs (``detect`` from ``detect_s``).

    Raises:
        ValueError: the document has no successful run of ``case``.
    """
    runs = _runs(doc, case)
    if not runs:
        raise ValueError(f"mttr JSON: no successful {case!r} run to take the phases from")
    out = {"detect": _median([1000 * r["detect_s"] for r in runs if "detect_s" in r])}
    for p in PHASES:
        out[p] = _median([r["phases_ms"][p] for r in runs if p in r.get("phases_ms", {})])
    return {k: v for k, v in out.items() if v is not None}


def case_mttr_s(doc: Mapping[str, Any], case: str) -> float | None:
    """The median MTTR of ``case`` (None: not run, or no run succeeded)."""
    return _median([r["mttr_s"] for r in _runs(doc, case)])


def ranks_per_node(doc: Mapping[str, Any]) -> int | None:
    return doc.get("args", {}).get("tasks_per_node")


def checkpoint_costs(doc: Mapping[str, Any], state_gb_per_rank: float) -> dict[str, float]:
    """Blocking checkpoint costs per rank at ``state_gb_per_rank``, scaled from the
    benchmark's own state: ``toolkit_s`` (the stall ``save()`` costs training) and
    ``baseline_s`` (torch.save + fsync, synchronous), with the measured figures."""
    gb = doc["bytes"] / 1e9
    fig = doc["figures"]
    scale = state_gb_per_rank / gb
    out = {"measured_gb": gb, "scale": scale, "toolkit_stall_s": fig["ours_stall"]["median_s"],
           "toolkit_s": fig["ours_stall"]["median_s"] * scale}
    if "torch_save_write" in fig:
        out["baseline_write_s"] = fig["torch_save_write"]["median_s"]
        out["baseline_s"] = fig["torch_save_write"]["median_s"] * scale
    return out
