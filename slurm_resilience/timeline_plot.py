"""`slurm-resilience timeline JOBDIR --png out.png`: what an operator asks after a fault.

Top: one lane per rank (and per warm spare), coloured by state — training,
checkpoint stall, recovering, lost, standby — with the nodes each rank ran on.
Middle: steps completed over time per rank (the pause and the catch-up show).
Bottom: one zoomed panel per recovery, its axis in milliseconds from the fault:
detection and each phase as a labelled bar, with the fault, the detection and the
first step after recovery marked; when detection dominates (a silent node: seconds of
stale heartbeats before phases of milliseconds) the axis is broken between the wait
and the recovery, so both read. What is drawn is computed in
:mod:`slurm_resilience.timeline_lanes`. Needs matplotlib (``test``/``plot`` extras).
"""

from __future__ import annotations

import os
from typing import Any

from .timeline_lanes import lanes, recoveries, step_series


__all__ = ["STATE_COLOURS", "PHASE_COLOURS", "MAX_PANELS", "SPLIT_RATIO", "plot_timeline", "breaks_axis"]


STATE_COLOURS = {"starting": "#d9d9d9", "training": "#59a14f", "checkpoint": "#4e79a7",
                 "recovering": "#f28e2b", "lost": "#e15759", "standby": "#bab0ac"}
PHASE_COLOURS = {"detect": "#e15759", "classify": "#4e79a7", "replace": "#f28e2b", "ranktable": "#b07aa1",
                 "reconnect": "#76b7b2", "restore": "#59a14f", "first_step": "#edc948"}
MAX_PANELS = 4  # recoveries zoomed (the first ones); the lanes show all
SPLIT_RATIO = 3.0  # detection longer than this many times the rest of the recovery: break the axis


def plot_timeline(events: list[dict[str, Any]], path: str, fault_times: dict[int, float] | None = None) -> str:
    """Write the picture to ``path``; ``fault_times``: {recovery: injection time}, when known."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(e["t"] for e in events)
    ls = lanes(events, fault_times)
    every = recoveries(events, fault_times)
    recs = every[:MAX_PANELS]
    n_panels = max(1, len(recs))
    fig = plt.figure(figsize=(12, 2.0 + 0.35 * len(ls) + 2.4 + (2.6 if recs else 0)))
    grid = fig.add_gridspec(3 if recs else 2, n_panels,
                            height_ratios=[max(1.0, 0.35 * len(ls)), 2.2] + ([2.4] if recs else []))
    ax_l = fig.add_subplot(grid[0, :])
    for y, lane in enumerate(ls):
        for a, b, state in lane.spans:
            ax_l.barh(y, b - a, left=a - t0, height=0.6, color=STATE_COLOURS[state], linewidth=0)
    ax_l.set_yticks(range(len(ls)), [lane.label for lane in ls], fontsize=8)
    ax_l.invert_yaxis()
    for rec in every:
        ax_l.axvline(rec.fault_at - t0, color="#e15759", linestyle=":", linewidth=0.8)
    ax_l.legend(handles=[Patch(color=c, label=s) for s, c in STATE_COLOURS.items()], fontsize=7, ncol=6,
                loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax_s = fig.add_subplot(grid[1, :], sharex=ax_l)
    for rank, pts in sorted(step_series(events).items()):
        ax_s.plot([t - t0 for t, _ in pts], [s for _, s in pts], marker=".", markersize=3, linewidth=1,
                  label=f"rank {rank}")
    for rec in every:
        ax_s.axvspan(rec.fault_at - t0, rec.first_step - t0, color="#f28e2b", alpha=0.25)
    ax_s.set_ylabel("steps done", fontsize=8)
    ax_s.set_xlabel("seconds since the job's first event", fontsize=8)
    ax_s.legend(fontsize=7, ncol=8, loc="upper left")
    for i, rec in enumerate(recs):
        _recovery_panel(fig, grid[2, i], rec)
    fig.suptitle("slurm_resilience timeline", fontsize=10)
    fig.tight_layout()
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)  # never a half-written picture at ``path``
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def breaks_axis(rec) -> bool:
    """The panel's axis is broken when detection takes over ``SPLIT_RATIO`` times the
    rest of the recovery (fault → detection ≫ detection → first step)."""
    return rec.detected - rec.fault_at > SPLIT_RATIO * max(rec.first_step - rec.detected, 0.001)


def _recovery_panel(fig, cell, rec) -> None:
    """One recovery in ms from the fault (its injection time when given, else its first sign).

    When detection dominates (a silent node: ~2 s of stale heartbeats, then phases of
    tens of ms) the axis is broken in two: the detection wait on the left, the
    recovery after it on the right, both in ms since the fault."""
    base = rec.fault_at
    detected, end = (rec.detected - base) * 1000, (rec.first_step - base) * 1000
    after = end - detected
    if not breaks_axis(rec):
        ax = fig.add_subplot(cell)
        _bars(ax, rec, labels=True)
        _marks(ax, rec, fault=True, detected=True, first=True)
        ax.set_xlim(-0.03 * end - 0.5, end * 1.3 + 1)
        ax.set_xlabel(f"ms since the {_fault_word(rec)}", fontsize=7)
        _title(ax, rec, end)
        return
    from matplotlib.ticker import MaxNLocator

    sub = cell.subgridspec(1, 2, width_ratios=[1, 2.6], wspace=0.04)
    left = fig.add_subplot(sub[0, 0])
    right = fig.add_subplot(sub[0, 1], sharey=left)
    _bars(left, rec, labels=False)
    _bars(right, rec, labels=True)
    left.text(detected / 2, 0, f"{detected:.0f} ms to detect", va="center", ha="center", fontsize=7, color="white")
    left.xaxis.set_major_locator(MaxNLocator(nbins=3))
    right.xaxis.set_major_locator(MaxNLocator(nbins=6))
    _marks(left, rec, fault=True, detected=False, first=False)
    _marks(right, rec, fault=False, detected=True, first=True)
    left.set_xlim(-0.03 * detected, detected * 1.0)
    right.set_xlim(detected - 0.08 * after, end + 0.35 * after)
    left.spines["right"].set_visible(False)
    right.spines["left"].set_visible(False)
    right.tick_params(axis="y", left=False, labelleft=False)
    for ax, x in ((left, 1.0), (right, 0.0)):  # the break: two short slashes on each side
        kw = dict(transform=ax.transAxes, color="k", clip_on=False, linewidth=0.8)
        for y in (0.0, 1.0):
            ax.plot([x - 0.012, x + 0.012], [y - 0.03, y + 0.03], **kw)
    right.set_xlabel(f"ms since the {_fault_word(rec)} (axis broken: the wait to detect it | the recovery)",
                     fontsize=7)
    _title(left, rec, end, loc="left")


def _fault_word(rec) -> str:
    return "fault injected" if rec.injected else "fault first seen"


def _bars(ax, rec, *, labels: bool) -> None:
    base = rec.fault_at
    bars = [("detect", rec.fault_at, rec.detected)] + list(rec.phases)
    for y, (name, a, b) in enumerate(bars):
        ms = (b - a) * 1000
        ax.barh(y, max(ms, 0.05), left=(a - base) * 1000, height=0.6, color=PHASE_COLOURS.get(name, "grey"))
        if labels:
            ax.text((max(a, b) - base) * 1000, y, f" {ms:.1f} ms", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylim(len(bars) - 0.5, -0.5)
    ax.tick_params(axis="x", labelsize=7)


def _marks(ax, rec, *, fault: bool, detected: bool, first: bool) -> None:
    base = rec.fault_at
    marks = ((fault, 0.0, "#e15759", _fault_word(rec), -1.3), (detected, (rec.detected - base) * 1000, "#f28e2b",
             "detected", -0.7), (first, (rec.first_step - base) * 1000, "#59a14f", "first step", -1.0))
    for on, x, colour, what, y in marks:
        if on:
            ax.axvline(x, color=colour, linestyle="--", linewidth=0.9)
            ax.text(x, y, what, color=colour, fontsize=7, ha="left")


def _title(ax, rec, end: float, loc: str = "center") -> None:
    where = f"rank {rec.rank} on {rec.node}" if rec.node else "fault"
    ax.set_title(f"recovery {rec.number}: {rec.level} ({where}) — {end:.0f} ms from the {_fault_word(rec)} "
                 "to the first step", fontsize=8, pad=28, loc=loc)
