"""Liveness of the in-place path's processes, for a node that goes silent.

A frozen or hung node closes nothing: PRRTE 3.0.11 does not notice it (its daemon
heartbeat is off), and the survivors block in their next collective. So each process of
a ``run --mpi`` job touches a file of its own in the launch's event directory
(``beat-w{world rank}``) every ``SR_ULFM_BEAT_S`` seconds from a daemon thread (it
calls no MPI, and mpi4py releases the GIL in blocking calls). The supervisor reads the
files' times; a node all of whose processes went quiet for the node-silence deadline
(:func:`quiet_nodes`, pure) has its slurmd asked, and one that does not answer is lost
(``mpi/supervise.py``). A rank that died alone leaves its node answering: the ranks
repair that in place, and the supervisor only looks.
"""

from __future__ import annotations

import glob
import os
import re
import threading
from typing import Mapping

__all__ = ["BEAT_ENV", "Beat", "beat_path", "read_beats", "quiet_nodes"]

BEAT_ENV = "SR_ULFM_BEAT_S"
_NAME = re.compile(r"beat-w(\d+)$")


def beat_path(events_dir: str, wid: int) -> str:
    """The beat file of world rank ``wid``."""
    return os.path.join(events_dir, f"beat-w{wid}")


class Beat:
    """A daemon thread that touches ``path`` every ``period_s`` until :meth:`stop`."""

    def __init__(self, path: str, period_s: float) -> None:
        self.path, self.period_s = path, period_s
        self._stop = threading.Event()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        self._thread = threading.Thread(target=self._run, name="sr-ulfm-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                os.utime(self.path)
            except OSError:
                return  # the event directory is gone: the job is over

    def stop(self) -> None:
        self._stop.set()


def read_beats(events_dir: str) -> dict[int, float]:
    """World rank -> last beat (the file's mtime) of every beat file in ``events_dir``."""
    out: dict[int, float] = {}
    for path in glob.glob(os.path.join(events_dir, "beat-w*")):
        m = _NAME.search(path)
        if m is None:
            continue
        try:
            out[int(m.group(1))] = os.stat(path).st_mtime
        except OSError:
            continue
    return out


def quiet_nodes(beats: Mapping[int, float], node_of: Mapping[int, str], now: float, silence_s: float) -> list[str]:
    """Pure: the nodes whose every known process last beat more than ``silence_s`` ago,
    sorted. A process whose node is not known yet (no ``start`` event) is left out; a
    node with no beat file at all is never quiet (it has not started)."""
    newest: dict[str, float] = {}
    for wid, t in beats.items():
        node = node_of.get(wid)
        if node is not None and t > newest.get(node, float("-inf")):
            newest[node] = t
    return sorted(n for n, t in newest.items() if now - t > silence_s)
