"""Redone steps: which step indices were already reached earlier in the job.

A rollback (online recovery, a relaunch from a checkpoint, a requeue) makes the
loop run step indices again. ``step.replay`` says so, so a logger can skip them
(wandb rejects a step number that goes backwards). The job's *high-water* step
(steps completed, ever) must survive the loss of any one rank, and of every rank:

* every rank remembers the highest step it completed; the state sync of each
  generation max-reduces it over the ranks (any one survivor is enough);
* the state (checkpoints and the peer broadcast) carries it (``high_water``);
* the logger rank writes it to ``JOBDIR/high_water`` at each new step, so a job
  whose every rank was relaunched (process restart, requeue) still knows it.

The decisions are pure and below; the rest is done by ``statesync``/``safepoint``.
"""

from __future__ import annotations

import os


__all__ = ["MARK", "high_water", "is_replay", "logger_rank", "read_mark", "write_mark"]


MARK = "high_water"
"""The file under the job directory that holds the job's high-water step."""


def high_water(*known: int) -> int:
    """Pure: the job's high-water step from every source that knows one (>= 0)."""
    return max([0, *known])


def is_replay(index: int, high: int) -> bool:
    """Pure: step ``index`` was completed before (the job had completed ``high`` steps)."""
    return index < high


def logger_rank(world_size: int) -> int:
    """Pure: the rank that logs. Rank 0: survivors keep their rank in every new rank
    table (``supervisor/decide/ranktable.regenerate``), so rank 0 is the same process unless
    that process is lost."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return 0


def read_mark(job_dir: str) -> int:
    """The high-water step in ``JOBDIR/high_water``; 0 when there is none or it is unreadable."""
    if not job_dir:
        return 0
    try:
        with open(os.path.join(job_dir, MARK)) as f:
            return max(0, int(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0


def write_mark(job_dir: str, step: int) -> None:
    """Write the high-water step: atomic (rename), 0600, not fsynced (it is a hint for
    logging, written every step; a node crash may lose the last few)."""
    path = os.path.join(job_dir, MARK)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{step}\n")
    os.replace(tmp, path)
