"""`slurm-resilience timeline JOBDIR --png out.png`: a Gantt chart of a job's recoveries.

One row per recovery (its phases as coloured bars, from the event log) and one row
of rank 0's checkpoint stalls; faults are marked. Times are seconds since the job
started. Needs matplotlib (in the ``test`` and ``plot`` extras).
"""

from __future__ import annotations

from typing import Any

from .protocol import EventKind, RecoveryPhase, WorkerEvent

PHASE_COLOURS = {RecoveryPhase.CLASSIFY: "#4e79a7", RecoveryPhase.REPLACE: "#f28e2b",
                 RecoveryPhase.RANKTABLE: "#e15759", RecoveryPhase.RECONNECT: "#76b7b2",
                 RecoveryPhase.RESTORE: "#59a14f", RecoveryPhase.FIRST_STEP: "#edc948"}


def plot_timeline(events: list[dict[str, Any]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["t"] for e in events)
    recs = sorted({e["recovery"] for e in events if e["kind"] == EventKind.PHASE})
    rows = [f"recovery {r}" for r in recs] + ["checkpoint stalls (rank 0)"]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * len(rows)))
    for y, r in enumerate(recs):
        for e in (e for e in events if e["kind"] == EventKind.PHASE and e["recovery"] == r):
            ax.barh(y, max(e["end"] - e["start"], 1e-4), left=e["start"] - t0, height=0.5,
                    color=PHASE_COLOURS.get(e["phase"], "grey"), label=e["phase"])
    y = len(recs)
    for e in events:
        if e["kind"] == WorkerEvent.CHECKPOINT_SAVED.logged and e.get("rank") == 0:
            ax.barh(y, e["stall_ms"] / 1000, left=e["t"] - t0 - e["stall_ms"] / 1000, height=0.5, color="black")
    for e in events:
        if e["kind"] == EventKind.FAULT_DETECTED:
            ax.axvline(e["observed_at"] - t0, color="red", linestyle="--", linewidth=0.8)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7, ncol=3)
    ax.set_xlim(0, max(e["t"] for e in events) - t0)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("seconds since job start (red: fault detected)")
    ax.set_title("slurm_resilience timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
