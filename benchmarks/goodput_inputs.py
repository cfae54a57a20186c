"""benchmarks/goodput.py's inputs, read from what the other benchmarks measured.

* ``mttr.json`` (benchmarks/mttr.py): the online phases from the kill-node case's
  medians (detect = fault → detection; the rest from its ``phase`` events); the
  process-fault and hang downtimes from the kill-rank and hang-rank medians; the
  silent-loss downtime from the freeze-node case when it was run.
* the requeue and in-job restart downtimes (:func:`downtimes`): ``peers.json``
  (benchmarks/peers.py) for the peers' requeue and in-job restart, the mttr JSON for
  our own no-spare requeue and the plain resubmit; an assumption only where neither has
  the figure, and the output says which.
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


# Where no measurement is given, the old modelling assumptions stand, labelled as such.
ASSUMED_REQUEUE_S = 600.0
ASSUMED_IN_JOB_RESTART_S = 300.0
IN_JOB_RESTART_PEERS = ("torchrun", "nvrx")  # peers that restart every rank inside the allocation


def peer_best_s(peers: Mapping[str, Any], fault: str, systems: tuple[str, ...] | None = None) -> tuple[float, str] | None:
    """The fastest peer's median for ``fault`` in peers.json (benchmarks/peers.py:
    ``results[fault][system]["median_s"]``), ours left out; ``(seconds, system)`` or None."""
    cells = peers.get("results", {}).get(fault, {})
    got = [(c["median_s"], s) for s, c in cells.items()
           if s != "ours" and (systems is None or s in systems) and isinstance(c, dict) and c.get("median_s")]
    return min(got) if got else None


def downtimes(mttr: Mapping[str, Any] | None, peers: Mapping[str, Any] | None,
              names: Mapping[str, str]) -> dict[str, tuple[float, str]]:
    """The requeue and in-job restart downtimes (s) for the model, each with its source:

    * ``baseline_requeue``: the fastest peer's requeue (peers.json), else our own plain
      ``sbatch`` + resubmit with detection for free (mttr JSON ``baseline-instant-detection``),
      else the assumption (600 s);
    * ``in_job_restart``: the fastest in-job restart peer (torchrun, NVRx) after a killed
      rank (peers.json ``kill-rank``), else the assumption (300 s);
    * ``toolkit_requeue``: our no-spare requeue (mttr JSON ``requeue-resubmit``, else
      ``requeue``), else ours in peers.json's requeue, else the assumption (600 s).

    ``names``: the file names to cite (keys ``mttr``, ``peers``).
    """
    mttr, peers = mttr or {}, peers or {}
    out: dict[str, tuple[float, str]] = {}
    best = peer_best_s(peers, "requeue")
    plain = case_mttr_s(mttr, "baseline-instant-detection")
    out["baseline_requeue"] = (
        (best[0], f"{names.get('peers')}: requeue, fastest peer ({best[1]})") if best else
        (plain, f"{names.get('mttr')}: baseline-instant-detection (plain sbatch + resubmit)") if plain else
        (ASSUMED_REQUEUE_S, "assumed (no peers.json requeue, no baseline in the mttr JSON)"))
    best = peer_best_s(peers, "kill-rank", IN_JOB_RESTART_PEERS)
    out["in_job_restart"] = (
        (best[0], f"{names.get('peers')}: kill-rank, fastest in-job restart ({best[1]})") if best else
        (ASSUMED_IN_JOB_RESTART_S, "assumed (no torchrun/NVRx kill-rank in peers.json)"))
    case = "requeue-resubmit" if case_mttr_s(mttr, "requeue-resubmit") else "requeue"
    ours = case_mttr_s(mttr, case)
    ours_peers = peers.get("results", {}).get("requeue", {}).get("ours", {})
    ours_peers = ours_peers.get("median_s") if isinstance(ours_peers, dict) else None
    out["toolkit_requeue"] = (
        (ours, f"{names.get('mttr')}: {case} (no spare)") if ours else
        (ours_peers, f"{names.get('peers')}: requeue, ours") if ours_peers else
        (ASSUMED_REQUEUE_S, "assumed (no requeue case in the mttr JSON)"))
    return out
