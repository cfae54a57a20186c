"""The supervisor's notices to a node's pulse, and what the pulse keeps of them.

Standard library only: the pulse (``pulse.py``, run as ``python -I``) loads this file by
path. The supervisor writes JSON lines on the pulse's liveness connection
(``supervisor/observe/detect.LivenessServer.tell``, ``ask_probes``):

* ``{"plan": g, "body": <the plan's JSON>}``: generation g's plan is published; the
  pulse keeps the body beside its ranks' pages (:func:`plan_path`) and then writes g into
  every page (``pulse.stamp_told``), where the ranks look (``plan_watch.py``);
* ``{"plan": g, "base": b, "delta": {...}, "crc": c}``: the same, sent to a pulse the
  supervisor already sent plan b whole: only what changed (:func:`plan_delta`; a node
  replaced changes a few hundred bytes of a plan of ~100 KB at 16,384 ranks, which every
  node would otherwise get). The pulse rebuilds the text (:func:`apply_delta`, the plan's
  canonical JSON) and keeps it only if its CRC-32 is ``c``; else its ranks ask the store;
* ``{"shutdown": 1}``: the job is over (waiting standbys exit);
* ``{"probe": {...}}``: a peer-probe request (``peer_probe.py``).
"""

from __future__ import annotations

import json
import os
import socket
import zlib
from typing import Any


__all__ = ["KEEP_PLANS", "Told", "plan_path", "messages", "plan_delta", "apply_delta", "plan_text", "crc"]


KEEP_PLANS = 2  # the newest plans a pulse keeps on file for its ranks


class Told:
    """What the supervisor has told this node's pulse: the newest plan's generation and
    whether the job is over (it only grows: a late or repeated notice changes nothing).
    With ``directory``, a notice's plan text (``body``) is written there first
    (:func:`plan_path`, 0600, whole or not at all), so a rank that reads the generation in
    its page finds the plan beside it; only the newest ``KEEP_PLANS`` are kept."""

    def __init__(self, directory: str | None = None) -> None:
        self.generation, self.ended = -1, False
        self._dir = directory
        self._texts: dict[int, str] = {}  # the newest KEEP_PLANS plan texts (a delta's base)
        self._docs: dict[int, dict] = {}  # their parsed forms, once a delta needed one

    def take(self, msg: dict) -> bool:
        """Fold one message in; True when it changed anything."""
        before = (self.generation, self.ended)
        try:
            if "plan" in msg and int(msg["plan"]) > self.generation:
                g = int(msg["plan"])
                body = msg.get("body") if isinstance(msg.get("body"), str) else self._rebuild(g, msg)
                if body is not None:
                    self._texts[g] = body
                    for old in [k for k in self._texts if k <= g - KEEP_PLANS]:
                        del self._texts[old]
                        self._docs.pop(old, None)
                    if self._dir is not None:
                        self._keep(g, body)
                self.generation = g
            if msg.get("shutdown"):
                self.ended = True
        except (TypeError, ValueError):
            pass
        return (self.generation, self.ended) != before

    def body(self, g: int) -> str | None:
        """Plan g's text as told (None: not kept, or its delta could not be rebuilt)."""
        return self._texts.get(g)

    def _rebuild(self, g: int, msg: dict) -> str | None:
        base = msg.get("base")
        if not isinstance(base, int) or base not in self._texts or not isinstance(msg.get("delta"), dict):
            return None
        try:
            doc = self._docs.get(base)
            if doc is None:
                doc = self._docs[base] = json.loads(self._texts[base])
            new = apply_delta(doc, msg["delta"])
            text = plan_text(new)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if crc(text) != msg.get("crc"):
            return None
        self._docs[g] = new
        return text

    def _keep(self, g: int, body: str) -> None:
        path = plan_path(self._dir, g)
        try:
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(path + ".tmp", path)
            for name in os.listdir(self._dir):  # the older ones: a rank that still wants one asks the store
                if name.startswith("plan.") and name[5:].isdigit() and int(name[5:]) <= g - KEEP_PLANS:
                    os.unlink(os.path.join(self._dir, name))
        except OSError:
            pass  # the ranks read the plan from the store instead

def plan_path(directory: str, g: int) -> str:
    """Where the node's pulse keeps generation ``g``'s plan for its ranks."""
    return os.path.join(directory, f"plan.{g}")


def messages(sock: socket.socket, buf: bytes) -> tuple[list[dict] | None, bytes]:
    """The supervisor's messages that arrived on the liveness connection (None: it closed):
    ``{"probe": {...}}`` requests and ``{"plan": g}`` / ``{"shutdown": 1}`` notices."""
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return [], buf
    except OSError:
        data = b""
    if not data:
        return None, b""
    *lines, buf = (buf + data).split(b"\n")
    out = []
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict):
            out.append(msg)
    return out, buf[-(64 << 20):]


def plan_text(doc: dict) -> str:
    """A plan's canonical JSON text (as ``protocol.Plan.to_json`` writes it)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def crc(text: str) -> int:
    """CRC-32 of a plan's text: a rebuilt plan is kept only if it matches the sender's."""
    return zlib.crc32(text.encode())


def plan_delta(old: dict, new: dict) -> dict:
    """What turns JSON object ``old`` into ``new``, key by key: ``{"v": value}`` (set),
    ``{"x": 1}`` (removed), ``{"d": delta}`` (an object, recursively), ``{"s": [a, b,
    items]}`` (a list: ``old[a:b]`` replaced by ``items``, from the common head and tail).
    A node replaced or removed is one splice per per-node list."""
    out: dict[str, Any] = {}
    for k, v in new.items():
        o = old.get(k, _MISSING)
        if o == v:
            continue
        if isinstance(v, dict) and isinstance(o, dict):
            out[k] = {"d": plan_delta(o, v)}
        elif isinstance(v, list) and isinstance(o, list):
            n, head, tail = min(len(o), len(v)), 0, 0
            while head < n and o[head] == v[head]:
                head += 1
            while tail < n - head and o[-1 - tail] == v[-1 - tail]:
                tail += 1
            out[k] = {"s": [head, len(o) - tail, v[head:len(v) - tail]]}
        else:
            out[k] = {"v": v}
    for k in old:
        if k not in new:
            out[k] = {"x": 1}
    return out


def apply_delta(old: dict, delta: dict) -> dict:
    """``old`` with ``delta`` (:func:`plan_delta`) applied; ``old`` is not changed.
    Raises KeyError, TypeError or ValueError on a delta that does not fit ``old``."""
    new = dict(old)
    for k, op in delta.items():
        if "x" in op:
            new.pop(k, None)
        elif "v" in op:
            new[k] = op["v"]
        elif "d" in op:
            if not isinstance(old[k], dict):
                raise TypeError(f"delta: {k!r} is not an object")
            new[k] = apply_delta(old[k], op["d"])
        elif "s" in op:
            a, b, items = op["s"]
            seq = old[k]
            if not (isinstance(seq, list) and isinstance(items, list) and 0 <= a <= b <= len(seq)):
                raise ValueError(f"delta: splice {a}:{b} does not fit {k!r}")
            new[k] = seq[:a] + items + seq[b:]
        else:
            raise ValueError(f"delta: unknown operation for {k!r}")
    return new


_MISSING = object()
