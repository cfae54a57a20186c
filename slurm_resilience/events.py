"""The JSONL event log: one writer (the supervisor), any number of readers.

Each line is ``{"t": unix_time, "kind": ..., **fields}``. Every line is written
through to the page cache at once (a crashed writer loses nothing, readers see it), and
fsynced at most every ``sync_every_s`` and at ``close()`` (:class:`EventLog`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from .protocol import EventKind

__all__ = ["EventLog", "read_events", "format_timeline"]


class EventLog:
    """Append-only JSONL log; use as a context manager or call ``close()``.

    Every event is written through to the page cache at once (readers in other
    processes see it; a crashed writer loses nothing), and fsynced at most every
    ``sync_every_s`` and at ``close()``: a recovery logs three events per rank, and an
    fsync per line (milliseconds each) put thousands of them on its critical path."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.time,
                 on_event: Callable[[dict[str, Any]], None] | None = None, sync_every_s: float = 0.5) -> None:
        self.path = path
        self._sync_every_s = sync_every_s
        self._synced = 0.0  # monotonic time of the last fsync
        self._clock = clock
        self._on_event = on_event
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()  # background isolations emit too

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return it. Raises OSError, TypeError (not JSON-able).

        ``kind`` is an :class:`~slurm_resilience.protocol.EventKind` or a worker's
        ``WorkerEvent.X.logged``; the line holds its plain string value.
        """
        return self.emit_many([(kind, fields)])[0]

    def emit_many(self, items: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Append several events (``(kind, fields)`` each) with one write and one flush.

        A recovery logs three events per rank: at 16,384 ranks a write and flush per
        line cost seconds of the supervisor's loop. Raises as :meth:`emit`."""
        t = self._clock()
        events = [{"t": t, "kind": str(kind), **fields} for kind, fields in items]
        if not events:
            return events
        text = "".join(_ENCODE(e) + "\n" for e in events)  # insertion order: t, kind, fields
        with self._lock:
            self._file.write(text)
            self._file.flush()
            now = time.monotonic()
            if now - self._synced >= self._sync_every_s:
                os.fsync(self._file.fileno())
                self._synced = now
            if self._on_event is not None:
                for event in events:
                    self._on_event(event)
        return events

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "value"):  # enums
        return obj.value
    raise TypeError(f"event field of type {type(obj).__name__} is not JSON serializable")


_ENCODE = json.JSONEncoder(default=_jsonable).encode  # built once (the C encoder), not per line


def read_events(path: str) -> list[dict[str, Any]]:
    """All events in order; a truncated (unparsable) last line is ignored.

    Raises:
        ValueError: a line other than the last is not valid JSON.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    events = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 or all(not rest.strip() for rest in lines[i + 1:]):
                break  # the writer died mid-line
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return events


_SKIP = ("t", "kind")


def format_timeline(events: list[dict[str, Any]]) -> str:
    """Readable timeline: one line per event, then a phase table per recovery.

    Times are relative to the first event. Phases come from ``phase`` events
    (fields ``recovery``, ``phase``, ``start``, ``end``); a recovery is listed
    when it has a ``recovery_start`` or any phase.
    """
    start_kinds = (EventKind.RECOVERY_START, EventKind.RECOVERY_DONE, EventKind.PHASE)
    if not events:
        return "(no events)\n"
    t0 = events[0]["t"]
    lines = []
    for ev in events:
        rest = " ".join(f"{k}={_fmt(v)}" for k, v in ev.items() if k not in _SKIP)
        lines.append(f"+{ev['t'] - t0:.3f}s  {ev['kind']}  {rest}".rstrip())
    recoveries: dict[Any, list[dict[str, Any]]] = {}
    for ev in events:
        if ev.get("kind") in start_kinds and "recovery" in ev:
            recoveries.setdefault(ev["recovery"], [])
            if ev["kind"] == EventKind.PHASE:
                recoveries[ev["recovery"]].append(ev)
    for rec, phases in recoveries.items():
        start = next((e["t"] for e in events if e.get("kind") == EventKind.RECOVERY_START and e.get("recovery") == rec), None)
        done = next((e["t"] for e in events if e.get("kind") == EventKind.RECOVERY_DONE and e.get("recovery") == rec), None)
        total = f"{(done - start) * 1000:.1f} ms" if start is not None and done is not None else "unfinished"
        lines.append("")
        lines.append(f"recovery {rec}: {total}")
        width = max([len("phase")] + [len(str(p["phase"])) for p in phases])
        lines.append(f"  {'phase'.ljust(width)}  duration_ms")
        for p in phases:
            lines.append(f"  {str(p['phase']).ljust(width)}  {(p['end'] - p['start']) * 1000:11.1f}")
    return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) and " " not in v else json.dumps(v, sort_keys=True)
