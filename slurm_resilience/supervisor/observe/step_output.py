"""What the relaunch path's all-ranks step writes, read back (pure but for ``read_from``).

Three signs, each from a file of the job dir:

* ``progress-NNN.log`` (``SR_PROGRESS_FILE``): ``STEP UNIX_TIME`` per completed step,
  appended by the program; its first line ends the recovery (:func:`first_progress`);
* ``step-NNN.log``, the step's output: the first line ``run.step_pattern`` matches
  stands in for a progress line (:func:`step_in_output`);
* the same output holds ``srun``'s own lines: ``srun: error: n3: task 1: Killed``
  names the rank that ended an MPI step under ``--kill-on-bad-exit=1``
  (:func:`name_first_exit`);
* the progress file read as it grows (:class:`ProgressTail`): an MPI step whose lines
  stop past the hard step timeout is hung (:func:`stalled_step`): one rank stopped
  (SIGSTOP, a dead loop) leaves the others blocked in MPI, and nothing exits.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Sequence

from ...model import Fault, FaultKind
from ...slurm.parse import compress_hostlist, parse_task_exits
from .watchdog import derive_timeouts

PROGRESS_VAR = "SR_PROGRESS_FILE"

__all__ = ["PROGRESS_VAR", "progress_path", "first_progress", "step_in_output", "name_first_exit", "read_from",
           "read_tail", "ProgressTail", "stalled_step"]


def progress_path(job_dir: str, attempt: int) -> str:
    """The relaunch's own progress file: a line there is this step's, never an older one's."""
    return os.path.join(job_dir, f"progress-{attempt:03d}.log")


def first_progress(data: bytes) -> tuple[int | None, float | None] | None:
    """Pure: the first complete line of a progress file as (step, unix time), each None
    where the line does not give it (any line is a step trained); None: no line yet.

    ``STEP UNIX_TIME`` is what ``examples/train_torchrun.py`` writes; a line without a
    time is timed when it is seen.
    """
    end = data.find(b"\n")
    if end < 0:
        return None
    fields = data[:end].split()
    if not fields or not fields[0].isdigit():
        return None, None  # not STEP UNIX_TIME: its other fields say nothing
    try:
        t = float(fields[1]) if len(fields) > 1 else None
    except ValueError:
        t = None
    return int(fields[0]), t


def step_in_output(data: bytes, pattern: re.Pattern[str]) -> tuple[int | None, None] | None:
    """Pure: the first complete line of a step's output that ``pattern`` (``run.step_pattern``)
    matches, as (step, None) like :func:`first_progress` (step: its group ``step``, else
    its first group, when that is a number); None: no line matches."""
    for line in data[:data.rfind(b"\n") + 1].decode(errors="replace").splitlines():  # complete lines
        m = pattern.search(line)
        if m:
            group = m.groupdict().get("step") or (m.group(1) if pattern.groups else None)
            return (int(group) if group and group.isdigit() else None), None
    return None


def name_first_exit(faults: Sequence[Fault], output: bytes) -> list[Fault]:
    """Pure: ``faults`` with the step's PROCESS_DIED fault naming the first bad task exit
    ``srun`` wrote to ``output`` (the root cause: under ``--kill-on-bad-exit=1`` the other
    tasks were ended after it). The fault stays the whole step's (rank None): a relaunch
    restarts every rank, and one rank's death says nothing against its node."""
    exits = parse_task_exits(output.decode(errors="replace"))
    if not exits:
        return list(faults)
    cause = f"; first bad exit: {exits[0].line()}"
    return [dataclasses.replace(f, detail=f.detail + cause) if f.kind is FaultKind.PROCESS_DIED else f
            for f in faults]


def read_from(path: str, offset: int) -> bytes | None:
    """The file's bytes from ``offset`` (at most 1 MiB); None: no file yet."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20)
    except FileNotFoundError:
        return None


def read_tail(path: str, start: int, limit: int = 1 << 16) -> bytes:
    """The last ``limit`` bytes of the file after ``start`` (where this step's output
    began); ``srun``'s lines about the end of a step are the last it wrote."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - limit))
            return f.read()
    except FileNotFoundError:
        return b""


class ProgressTail:
    """One step's progress file, read as it grows: ``seen_at``, when its last line was
    seen (the caller's monotonic clock: no skew between nodes), and ``steps``, the recent
    step times (from the lines' own times: one writer, one clock)."""

    def __init__(self, path: str, *, keep: int = 8) -> None:
        self.path, self.offset = path, 0
        self.seen_at: float | None = None  # None: no line yet (start-up, snapshot load)
        self.last_t: float | None = None
        self.steps: collections.deque[float] = collections.deque(maxlen=keep)

    def poll(self, now: float) -> None:
        """Read the complete lines written since the last call."""
        data = read_from(self.path, self.offset) or b""
        whole = data[:data.rfind(b"\n") + 1]
        if not whole:
            return
        self.offset += len(whole)
        self.seen_at = now
        for line in whole.splitlines():
            got = first_progress(line + b"\n")
            t = got[1] if got else None
            if t is not None and self.last_t is not None and t >= self.last_t:
                self.steps.append(t - self.last_t)
            self.last_t = t if t is not None else self.last_t


def stalled_step(nodes: Sequence[str], *, quiet_s: float | None, steps: Sequence[float], hard_s: float,
                 factor: float, now: float) -> Fault | None:
    """Pure: the whole step's PROCESS_HUNG fault when its progress file has been quiet
    (``quiet_s``) past the hard step timeout, ``max(hard_s, factor x the longest recent
    step)`` (``watchdog.derive_timeouts``, the torch path's rule); None before the
    step's first line (``quiet_s`` None: start-up is not a hang) or while it moves."""
    if quiet_s is None:
        return None
    limit = derive_timeouts(steps, stale_s=hard_s, soft_s=hard_s, hard_s=hard_s, factor=factor).hard_s
    if quiet_s <= limit:
        return None
    return Fault(FaultKind.PROCESS_HUNG, None, compress_hostlist(nodes), now,
                 f"no progress line for {quiet_s:.1f} s, past the hard step timeout {limit:.1f} s "
                 f"(detect.progress_hard_s, or progress_factor x the longest recent step, "
                 f"{max(steps, default=0.0):.2f} s): a rank stopped and the others wait in MPI")
