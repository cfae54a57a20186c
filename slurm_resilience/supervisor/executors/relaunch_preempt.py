"""Preemption of a ``slurm-resilience run`` job: ask the program to persist, then requeue.

    --signal=B:USR1@90 (job.preempt_signal) ─► supervisor (the batch shell)
      └─ Preempted → decide: requeue(persist=True)
           Publish(PERSIST)  the request file JOBDIR/preempt.request is written
           Reap(grace)       the step gets up to ``persist_wait_s`` to exit by itself
           Requeue           scontrol requeue (the same job id, the same job directory)

The signal goes to the supervisor only (``B:``), never to the step: Slurm signals every
process of a step's cgroup, a program's DataLoader workers included, and a forked rank
shares its step with the zygote. A program that understands the request (the Lightning
callback, ``integrations/lightning.py``) finishes its current step, copies that step's
snapshot to the job directory (durable) and exits; one that does not is cancelled when
the wait ends and resumes from its own newest snapshot.

Each rank of the step finds the job directory in ``SR_RUN_JOB_DIR`` (cold and warm
tasks alike); the request is ``JOBDIR/preempt.request``, removed before every launch.
"""

from __future__ import annotations

import contextlib
import os
import time

from ...protocol import preempt_request_path as request_path


__all__ = ["persist_wait_s", "write_request", "clear_request"]


def persist_wait_s(grace_s: float, preempt_signal: str) -> float:
    """Pure: how long the supervisor waits for the step to exit after the request: the
    plan's grace, at most half the signal's lead time (``USR1@90`` → 45 s), so that the
    requeue lands before Slurm ends the job."""
    lead = preempt_signal.split("@")[1] if "@" in preempt_signal else ""
    return min(grace_s, int(lead) / 2) if lead.isdigit() else grace_s


def write_request(job_dir: str, *, signal_name: str) -> str:
    """Create the request file (atomically: a rank never reads half of it); returns its path."""
    path = request_path(job_dir)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{signal_name or 'preempt'} {time.time():.6f}\n")
    os.replace(tmp, path)
    return path


def clear_request(job_dir: str) -> None:
    """A launch starts with no request (a requeued job's directory has the old one)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(request_path(job_dir))
