"""Heartbeats in the store: which are there, read in O(1) round trips, and which are stale.

Every rank's heartbeat thread writes ``hb/{worker}`` (``protocol.StoreKey.HEARTBEAT``)
each period; the supervisor reads them all once a poll (``watch.py``): one ``check``
and one ``multi_get`` whatever the number of ranks, never a round trip per rank.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

__all__ = ["stale_workers", "present_keys", "read_heartbeats"]


def stale_workers(beats: Mapping[str, float | None], now: float, timeout_s: float,
                  started: Mapping[str, float]) -> list[str]:
    """Pure: workers whose last heartbeat (or start, if none yet) is older than ``timeout_s``.

    A worker that has not beaten yet is given ``started + timeout_s`` plus start-up
    grace by the caller (``started`` holds the time from which to count).
    """
    out = []
    for wid, t in beats.items():
        last = t if t is not None else started.get(wid, now)
        if now - last > timeout_s:
            out.append(wid)
    return out


def present_keys(store, keys: Sequence[str]) -> list[str]:
    """The keys of ``keys`` that are in ``store``, in order, in as few round trips as it
    takes: one ``check`` of all of them when all are there (the steady state: every
    worker has beaten), else the halves recursively — O(missing · log N) round trips,
    never one per key. ``multi_get`` of a missing key would block until the store's
    timeout, so nothing absent may reach it."""
    if not keys:
        return []
    if store.check(list(keys)):
        return list(keys)
    if len(keys) == 1:
        return []
    mid = len(keys) // 2
    return present_keys(store, keys[:mid]) + present_keys(store, keys[mid:])


def read_heartbeats(store, keys: Mapping[str, str]) -> dict[str, dict | None]:
    """Last heartbeat per worker (``{"t", "step", "pid", ...}``; None when it never beat).

    Two round trips per poll whatever the number of workers (one ``check``, one
    ``multi_get``) once all have beaten; before, :func:`present_keys` bisects."""
    wids = list(keys)
    present = set(present_keys(store, [keys[w] for w in wids]))
    have = [w for w in wids if keys[w] in present]
    values = [bytes(v) for v in store.multi_get([keys[w] for w in have])] if have else []
    out: dict[str, dict | None] = {w: None for w in wids}
    try:  # one parse of all N values (2-3x faster than N calls); per value if one is torn
        parsed = json.loads(b"[" + b",".join(values) + b"]") if values else []
        if len(parsed) != len(values):
            raise ValueError("a value held more than one JSON document")
    except ValueError:
        parsed = [_one(v) for v in values]
    for w, beat in zip(have, parsed):
        out[w] = beat if isinstance(beat, dict) else None
    return out


def _one(raw: bytes) -> dict | None:
    try:
        return json.loads(raw)
    except ValueError:
        return None  # a torn or foreign value: as if the worker had not beaten
