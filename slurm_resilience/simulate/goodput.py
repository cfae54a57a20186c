"""Discrete-event goodput simulator: the ETTR of a recovery strategy under failures.

The model
---------
The job trains at constant speed. Its *progress* P is the training time embodied in
the state it holds. Steps lie on a grid of ``step_time_s`` in progress; checkpoints
on a grid of ``interval_s`` rounded to whole steps, each blocking training for
``cost_s``. Failures arrive as independent Poisson processes, one per category. A
failure picks a recovery path from the strategy by the category's fault class; the
path rolls P back (to the last step boundary, or to the last completed checkpoint)
and stops training for ``downtime_s``. A fault after the step's gradient
collective (``Strategy.collective_at``) cannot stop the survivors: they finish
the step during the recovery instead of losing it::

    progress ─train─┐ckpt┌─train──────X          (X: fault; lost = P - restore point)
                                     └─recovery─┐ (downtime_s)
                                                └─train from the restore point ─…

A fault during a recovery restarts recovery from its own time with the slower of
the two paths (conservative: the job is rebuilt again). A node fault on a path that
needs a spare takes one from the pool and the failed node returns as a spare after
``repair_s``; with none left the strategy's ``on_no_spare`` path runs. A path with
``new_allocation`` (a requeue) refills the pool and forgets pending repairs. Every
second of wall time is exactly one of: productive, lost work (trained, then rolled
back), recovery, checkpoint.

The modules, in the order a simulation uses them::

    failures.py    fault classes, failure categories (Llama 3 rates), Cluster
    strategies.py  recovery paths, checkpoint spec, the three strategies
    engine.py      simulate(): the discrete-event run; summarize() over seeds
    validate.py    closed-form ETTR; predicted vs measured for one real run
    measured.py    pure readers of a real run: fault schedule, window, ETTR, phases

This module re-exports their public names (the import path the benchmarks and
tests use).
"""

from __future__ import annotations

from .engine import SimResult, simulate, summarize
from .failures import DAY_S, LLAMA3_CATEGORIES, LLAMA3_INTERRUPTIONS, LLAMA3_TABLE5, Cluster, FailureCategory, FailureModel, FaultClass
from .strategies import (
    PHASE_NAMES, CheckpointSpec, PhaseTimes, RecoveryPath, Rollback, Strategy,
    in_job_restart, requeue_baseline, toolkit_default,
)
from .validate import expected_ettr, validate_against_run

__all__ = [
    "FaultClass", "FailureCategory", "LLAMA3_CATEGORIES", "LLAMA3_TABLE5", "LLAMA3_INTERRUPTIONS", "FailureModel", "Cluster",
    "Rollback", "RecoveryPath", "CheckpointSpec", "Strategy", "PhaseTimes", "PHASE_NAMES",
    "toolkit_default", "requeue_baseline", "in_job_restart", "SimResult",
    "simulate", "summarize", "expected_ettr", "validate_against_run", "DAY_S",
]
