"""What the orchestrator measures: /proc CPU and memory, the job's event log, summaries."""

from __future__ import annotations

import json
import os
import statistics
from typing import Iterable

TICK = os.sysconf("SC_CLK_TCK")

# Events that mean the supervisor suspected or acted on a healthy rank.
FALSE_ALARM_KINDS = frozenset({"fault_detected", "recovery_start", "suspect", "progress_slow", "straggler",
                               "isolated", "fallback"})


def cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime of ``pid`` (all its threads; ``tid``: that thread only), seconds."""
    with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / TICK


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


class EventTail:
    """The job's ``events.jsonl`` read as it grows (complete lines only)."""

    def __init__(self, path: str) -> None:
        self.path, self._offset, self._buf = path, 0, b""
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._buf = (self._buf + data).split(b"\n")
        new = [json.loads(ln) for ln in lines if ln.strip()]
        self.events += new
        return new

    def first(self, kind: str, **match) -> dict | None:
        return next((e for e in self.events if e["kind"] == kind
                     and all(e.get(k) == v for k, v in match.items())), None)


def false_alarms(events: Iterable[dict], start: float, end: float) -> list[dict]:
    """Events in [start, end] that suspect or act on a rank (no fault was injected)."""
    return [e for e in events if start <= e["t"] <= end and e["kind"] in FALSE_ALARM_KINDS]


def summary(values: list[float | None]) -> dict | None:
    """median, min, max and count of the values that were measured (None: not reached)."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got),
            "missing": len(values) - len(got)}
