"""Probe a silent node: does its slurmd answer a real Slurm request? Off the loop.

A node that loses power or hangs sends nothing: its ranks' connections stay open,
their heartbeats just stop, and its slurmd port may still accept TCP connections
(the kernel queues them for the stopped daemon). So when *every* watched worker on
a node is heartbeat-stale and none is known to have exited (``silent_nodes``), the
watch holds those suspects and asks the node's slurmd something it must answer
itself — ``sstat`` of one of our steps there (``Launcher.probe_slurmd``) — in a
thread, bounded by ``detect.slurmd_probe_deadline_s``. The answer comes back as a
:class:`NodeProbed` and rides on the suspects into ``decide``: silent past the
deadline → NODE_LOST (``classify.py``), answered → a process-level fault. The watch
starts the probe early, once every rank on the node has been quiet for the heartbeat
time-out less the deadline and one period, so that the verdict is usually in when
the heartbeats go stale (``watch.Watch._probe_early``). The connect is retried with a
fresh SYN every 50 ms (``slurm/reach.py``), and once it succeeds the request gets at
least ``ASK_MIN_S``: a node whose link flapped back during the probe answers.

Measured on the lab cluster (Slurm 22.05, frozen node = slurmd SIGSTOPped and the
job cgroups frozen): healthy, the connect + step list + sstat take 10-20 ms;
frozen, the connect still succeeds in 1 ms and sstat never answers.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Collection, Mapping, Sequence

__all__ = ["HOLD_GRACE_S", "ASK_MIN_S", "NodeProbed", "NodeProber", "silent_nodes", "pulse_gone", "PulseCloses",
           "PULSE_RECHECK_S"]

HOLD_GRACE_S = 1.0  # a probe thread past its deadline by this much is given up on
ASK_MIN_S = 0.25  # the Slurm request's time at least, after the connect


@dataclasses.dataclass(frozen=True)
class NodeProbed:
    """One probe's outcome. ``reachable``: the TCP connect to slurmd's port;
    ``answered``: the Slurm request (None: nothing to ask, or the probe broke)."""

    node: str
    reachable: bool
    answered: bool | None
    detail: str
    started: float
    ended: float


def silent_nodes(workers_by_node: Mapping[str, Sequence[str]], suspects: Mapping[str, Mapping[str, Any]],
                 quiet: Collection[str] = ()) -> set[str]:
    """Pure: the nodes whose every watched worker (``workers_by_node``) is a suspect
    with a stale heartbeat, or ``quiet`` (silent long enough that its probe has started,
    not stale yet: a frozen node's ranks beat last at slightly different times, so they
    turn stale over a period or two, not in one poll), with none seen exiting and no
    bad Slurm state reported, and at least one stale. A node with one worker that beats
    is not silent: its suspects are process-level."""
    out = set()
    for node, wids in workers_by_node.items():
        stale = [w for w in wids if suspects.get(w, {}).get("heartbeat_stale")]
        if stale and all((w in quiet and w not in suspects) or (
                w in stale and not suspects[w].get("process_exited") and not suspects[w].get("node_state"))
                for w in wids):
            out.add(node)
    return out


class NodeProber:
    """Runs probes in daemon threads (one per node at a time); ``drain`` collects.

    ``reachable(node, timeout_s)`` and ``probe(node, step_names, deadline_s)`` are
    the launcher's ``node_reachable`` and ``probe_slurmd``.
    """

    def __init__(self, reachable: Callable[[str, float], bool],
                 probe: Callable[[str, Sequence[str], float], tuple[bool | None, str]], deadline_s: float) -> None:
        self._reachable, self._probe, self.deadline_s = reachable, probe, deadline_s
        self._running: dict[str, float] = {}
        self._results: "queue.Queue[NodeProbed]" = queue.Queue()
        self._lock = threading.Lock()

    def start(self, node: str, step_names: Sequence[str]) -> bool:
        """Probe ``node`` unless a probe of it runs; True when one was started."""
        with self._lock:
            if node in self._running:
                return False
            self._running[node] = time.monotonic()
        threading.Thread(target=self._work, args=(node, tuple(step_names)), name=f"sr-probe-{node}",
                         daemon=True).start()
        return True

    def _work(self, node: str, names: tuple[str, ...]) -> None:
        t0 = time.time()
        t_mono = time.monotonic()
        reachable, answered, detail = True, None, ""
        try:
            reachable = self._reachable(node, self.deadline_s)
            if not reachable:
                answered, detail = False, "slurmd port refused or silent"
            else:
                # a connect that came late (the link flapped back) still leaves slurmd time to answer
                left = max(ASK_MIN_S, self.deadline_s - (time.monotonic() - t_mono))
                answered, detail = self._probe(node, names, left)
        except Exception as exc:  # a probe that breaks is no verdict
            answered, detail = None, f"probe failed: {exc}"
        with self._lock:
            self._running.pop(node, None)
        self._results.put(NodeProbed(node, reachable, answered, detail, t0, time.time()))

    def overdue(self, node: str) -> bool:
        """A probe of ``node`` runs past its deadline plus ``HOLD_GRACE_S`` (stuck)."""
        with self._lock:
            since = self._running.get(node)
        return since is not None and time.monotonic() - since > self.deadline_s + HOLD_GRACE_S

    def drain(self) -> list[NodeProbed]:
        """The probes finished since the last call (never blocks)."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out


def pulse_gone(node: str, t: float, watched: Sequence[str], reachable: Callable[[], bool],
               suspects: dict[str, dict[str, Any]]) -> bool:
    """The node's pulse connection closed: when its slurmd refuses too (``reachable``,
    asked only if the node has ``watched`` workers), the node is gone: its workers are
    suspects now, before their own connections close (a rank's process takes tens of
    milliseconds to be torn down, the pulse one). A pulse that ended on a live node (the
    job's end, a crash of its own) is nobody's fault: its ranks start a new one. False
    when slurmd still took the connection (``PulseCloses`` asks again)."""
    if watched and not reachable():
        for wid in watched:
            suspects.setdefault(wid, {"t": t})
        return True
    return not watched


PULSE_RECHECK_S = (0.02, 0.06, 0.15)
"""After a pulse's close that slurmd outlived, its slurmd is asked again this long after
the close: a node whose processes are all being killed (a reboot, a kill of the whole
node) closes their sockets in no set order, and its slurmd's listening one can still
take a connection just after the pulse's has closed."""


class PulseCloses:
    """The pulse closes whose node's slurmd still took a connection, asked again at
    ``PULSE_RECHECK_S`` after the close (each loop turn ``look``s; one connect a node
    each time, and only after a pulse has closed). ``reachable(node)``: the connect,
    bounded by ``detect.probe_timeout_s`` like the first ask; a re-ask follows a first
    connect that succeeded, so the node's network answered a moment before."""

    def __init__(self, reachable: Callable[[str], bool], delays: Sequence[float] = PULSE_RECHECK_S) -> None:
        self._reachable, self._delays = reachable, tuple(delays)
        self._due: dict[str, tuple[float, int]] = {}  # node -> (its pulse's close, next delay's index)

    def closed(self, node: str, t: float, watched: Sequence[str], suspects: dict[str, dict[str, Any]]) -> None:
        """A pulse of ``node`` closed at ``t``: its workers are suspects when slurmd refuses now."""
        if pulse_gone(node, t, watched, lambda: self._reachable(node), suspects):
            self._due.pop(node, None)
        elif self._delays:
            self._due[node] = (t, 0)

    def look(self, now: float, state: Any, suspects: dict[str, dict[str, Any]]) -> None:
        """Ask again about the nodes whose next delay has passed (``state``: the
        supervisor's; a node excluded since, or with no watched worker, is let go)."""
        for node, (t, i) in list(self._due.items()):
            if now < t + self._delays[i]:
                continue
            watched = [] if node in state.excluded else state.watched_on(node)
            if pulse_gone(node, t, watched, lambda n=node: self._reachable(n), suspects) \
                    or i + 1 == len(self._delays):
                del self._due[node]
            else:
                self._due[node] = (t, i + 1)
