"""The supervisor's notices to a node's pulse, and what the pulse keeps of them.

Standard library only: the pulse (``pulse.py``, run as ``python -I``) loads this file by
path. The supervisor writes JSON lines on the pulse's liveness connection
(``supervisor/observe/detect.LivenessServer.tell``, ``ask_probes``):

* ``{"plan": g, "body": <the plan's JSON>}``: generation g's plan is published; the
  pulse keeps the body beside its ranks' pages (:func:`plan_path`) and then writes g into
  every page (``pulse.stamp_told``), where the ranks look (``plan_watch.py``);
* ``{"shutdown": 1}``: the job is over (waiting standbys exit);
* ``{"probe": {...}}``: a peer-probe request (``peer_probe.py``).
"""

from __future__ import annotations

import json
import os
import socket


__all__ = ["KEEP_PLANS", "Told", "plan_path", "messages"]


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

    def take(self, msg: dict) -> bool:
        """Fold one message in; True when it changed anything."""
        before = (self.generation, self.ended)
        try:
            if "plan" in msg and int(msg["plan"]) > self.generation:
                if self._dir is not None and isinstance(msg.get("body"), str):
                    self._keep(int(msg["plan"]), msg["body"])
                self.generation = int(msg["plan"])
            if msg.get("shutdown"):
                self.ended = True
        except (TypeError, ValueError):
            pass
        return (self.generation, self.ended) != before

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
