"""A node cut from its peers only: the pulses probe each other, one node is blamed.

A node whose network to the other nodes fails while the supervisor and slurmctld still
reach it (a bad port or cable on the data network, a firewall rule) shows no sign of
trouble of its own: its heartbeats and pulse lines keep coming, its slurmd answers, and
every rank waits in a collective that never returns (gloo and NCCL name no culprit).
The watchdog alone calls every rank hung at the hard step timeout and relaunches all of
them, the cut node included, which hangs again.

So once every rank of the table has shown the same progress for ``detect.peer_probe_s``
(at least twice the longest recent step), the supervisor asks each node's pulse to
probe its peers (``worker/peer_probe.py``: a connect from the node's own address that
proves the job's secret and gets one byte back, ``PROBE_TIMEOUT_S`` each, in parallel)
and :func:`blame` reads the answers: the one node that every failed probe leads to or
from, with at least two distinct peers on the far ends, while some probe that does not
involve it succeeded, is cut from its peers. Its ranks become suspects with that
evidence; ``classify`` makes it ``NODE_PARTITIONED``, a node fault: replaced by a spare
and isolated like a lost node. No single explanation (two cut nodes, a split in
halves, a single failed link, no answers): no blame, and the watchdog decides as
before. The probes repeat at the same interval while the stall lasts.

The same probes answer a second question: a *silent* node (no heartbeat, no pulse
line) whose slurmd still answers Slurm was called hung in its processes and restarted
in place. When its peers still reach its pulse (:meth:`PartitionWatch.about`, asked of
``ABOUT_PEERS`` nodes, held at most ``ANSWER_WAIT_S``), it is the path between it and
the supervisor that failed: ``NODE_PARTITIONED`` too, and a restart in place there
would never rejoin.

Probes per round: every other node while there are at most ``PROBE_FANOUT`` + 1
nodes, else the nodes at ring distances 1, 2, 4, ... ahead (``PROBE_FANOUT`` of
them): O(N log N) connects, and a cut node is still probed by several peers.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Protocol, Sequence

__all__ = ["PROBE_FANOUT", "PeerLink", "PartitionWatch", "blame", "held_for_peers", "look", "probe_plan"]

PROBE_FANOUT = 8
ANSWER_WAIT_S = 1.5  # after a request: answers still missing are not waited for longer
ABOUT_PEERS = 3  # nodes asked whether they reach a silent node
ABOUT_KEEP_S = 2.0  # an answer about a silent node is reused this long (the silence look asks every 50 ms)


class PeerLink(Protocol):
    """The liveness server's side of the peer probes (``detect.LivenessServer``)."""

    def endpoints(self) -> dict[str, tuple[str, int]]:
        """Each node pulse's peer-probe endpoint (address, port)."""

    def reach(self) -> dict[str, dict[int, dict]]:
        """Each node pulse's newest peer-probe answers, by request id."""

    def ask_probes(self, requests: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Send each node's pulse its probe request; the nodes it could not be sent to."""


def probe_plan(nodes: Sequence[str], endpoints: Mapping[str, tuple[str, int]],
               fanout: int = PROBE_FANOUT) -> dict[str, dict[str, list]]:
    """Pure: node -> {peer: [addr, port]} it should probe (only nodes with an endpoint)."""
    known = [n for n in nodes if n in endpoints]
    count = len(known)
    if count < 2:
        return {}
    if count - 1 <= fanout:
        dists = list(range(1, count))
    else:
        dists, d = [], 1
        while d < count and len(dists) < fanout:
            dists.append(d)
            d *= 2
    return {a: {known[(i + d) % count]: list(endpoints[known[(i + d) % count]]) for d in dists}
            for i, a in enumerate(known)}


def blame(answers: Mapping[str, tuple[set[str], set[str]]]) -> tuple[str, str] | None:
    """Pure: ``answers`` node -> (peers it reached, peers it did not); the node cut from
    its peers and the evidence, or None when no single node explains the failures."""
    failed = [(a, b) for a, (_, bad) in answers.items() for b in bad]
    if not failed:
        return None
    common = set.intersection(*({a, b} for a, b in failed))
    if len(common) != 1:
        return None
    cut = common.pop()
    far = {b if a == cut else a for a, b in failed}
    fine = sum(1 for a, (ok, _) in answers.items() if a != cut for b in ok if b != cut)
    if len(far) < 2 or not fine:
        return None
    return cut, (f"cut from its peers: {len(failed)} peer probe(s) to or from it failed (peers "
                 f"{','.join(sorted(far)[:8])}{'...' if len(far) > 8 else ''}), while {fine} between the "
                 "other nodes answered")


class PartitionWatch:
    """When to ask for probes, and what their answers blame (one round at a time)."""

    def __init__(self, link: PeerLink, probe_s: float, clock=time.time) -> None:
        self._link, self.probe_s, self._clock = link, probe_s, clock
        self._round = 0
        self._asked: tuple[int, float, frozenset[str]] | None = None  # (id, when, nodes asked)
        self._about: dict[str, tuple[int, float, frozenset[str]]] = {}  # silent node -> (id, when, peers asked)
        self._said: dict[str, tuple[float, str]] = {}  # silent node -> (when, the answer about it)

    def look(self, nodes: Callable[[], Sequence[str]], stalled_s: float,
             longest_step_s: float) -> tuple[str, str] | None:
        """One look: ask for a round when the job has stalled long enough, read the answers
        of the round in flight. Returns (node, evidence) once per blamed round. ``nodes``
        is called only when a round is asked for (O(1) while the job moves)."""
        now = self._clock()
        interval = max(self.probe_s, 2 * longest_step_s)
        if self.probe_s <= 0 or stalled_s < interval:
            self._asked = None  # moving again (or off): a later stall starts afresh
            return None
        if self._asked is None or now - self._asked[1] >= interval:
            plan = probe_plan(nodes(), self._link.endpoints())
            if not plan:
                return None
            self._round += 1
            failed = self._link.ask_probes({n: {"id": self._round, "peers": p} for n, p in plan.items()})
            self._asked = (self._round, now, frozenset(plan) - set(failed))
            return None
        rid, when, asked = self._asked
        got = {n: (a[rid]["ok"], a[rid]["bad"]) for n, a in self._link.reach().items() if rid in a and n in asked}
        if not got or (len(got) < len(asked) and now - when < ANSWER_WAIT_S):
            return None
        missing = asked - set(got)  # asked but silent: its probes of others are unknown, not failed
        found = blame(got)
        self._asked = (rid, when, frozenset())  # this round is read; the next one after the interval
        if found is None:
            return None
        node, why = found
        return node, why + (f"; no answer from {','.join(sorted(missing))}" if missing else "")

    def about(self, node: str, nodes: Sequence[str]) -> str | None:
        """A silent node whose slurmd answers: does its pulse still answer its peers? The
        first call asks up to ``ABOUT_PEERS`` nodes after it in ``nodes`` (a ring); None
        while their answers are awaited (at most ``ANSWER_WAIT_S``), then the evidence
        that it is cut from the supervisor only, or "" (no peer reached it, none asked)."""
        now = self._clock()
        said = self._said.get(node)
        if said is not None and now - said[0] < ABOUT_KEEP_S:
            return said[1]
        if node not in self._about:
            eps = self._link.endpoints()
            ring = [n for n in nodes if n in eps and n != node]
            if node not in eps or not ring:
                return ""
            at = sum(1 for n in ring if n < node)
            peers = (ring[at:] + ring[:at])[:ABOUT_PEERS]
            self._round += 1
            failed = self._link.ask_probes({n: {"id": self._round, "peers": {node: list(eps[node])}} for n in peers})
            if set(peers) <= set(failed):
                return ""
            self._about[node] = (self._round, now, frozenset(peers) - set(failed))
            return None
        rid, when, peers = self._about[node]
        got = {n: a[rid] for n, a in self._link.reach().items() if rid in a and n in peers}
        if len(got) < len(peers) and now - when < ANSWER_WAIT_S:
            return None
        del self._about[node]
        reached = sorted(n for n, r in got.items() if node in r["ok"])
        why = "" if not reached or 2 * len(reached) < len(got) else (
            "cut from the supervisor only: no heartbeat or pulse line of it arrives, yet its slurmd answers "
            f"and its peers reach its pulse's port ({','.join(reached)})")
        self._said[node] = (now, why)
        return why


def held_for_peers(watch: Any, state: Any, node: str, verdict: Any, held: dict[str, dict[str, Any]]) -> bool:
    """A silent node whose slurmd answered (``verdict``, ``probe.NodeProbed``): True while
    its suspects wait for its peers' word; when they reach it, each suspect carries the
    evidence (``peers_cut``): the node, not its processes, is what failed."""
    pw, d = watch.partition, watch.cfg.detect
    if pw is None or not verdict.answered:
        return False
    if time.time() - watch.heard().get(node, 0.0) < (d.silence_s or d.heartbeat_timeout_s):
        return False  # its pulse's lines still come: its ranks are stale, not the node (a stopped rank)
    cut = pw.about(node, state.watched_nodes())
    if cut is None:
        return True
    if cut:
        for o in held.values():
            o["peers_cut"] = cut
    return False


def look(watch: Any, state: Any, suspects: dict[str, dict[str, Any]], now: float) -> None:
    """One look from the ``Watch`` (each heartbeat period, O(1) while the job moves): the
    ranks of a node blamed as cut from its peers become suspects with the evidence."""
    pw = watch.partition
    if pw is None or state.recovery is not None or not state.table.slots:
        return
    found = pw.look(state.watched_nodes, watch.progress.stalled_s(now), watch.progress.longest_step_s())
    if found is None:
        return
    node, why = found
    for wid in state.watched_on(node):
        suspects.setdefault(wid, {"t": now})["peers_cut"] = why
