"""A node gone silent, found in well under a second: nothing heard, then slurmd asked.

A node that loses power, hangs, or is cut off the network sends nothing and closes
nothing: its ranks' heartbeats stop and its pulse's lines stop, all at once. The
heartbeat timeout (2 s by default) is sized for one rank's interpreter that may be
starved; a whole node is quieter evidence: every rank's heartbeat *and* the node's
pulse, a separate tiny process, silent together. So once a node has been quiet for
``detect.node_silence_s - detect.slurmd_probe_deadline_s`` the watch asks its slurmd a
Slurm request (``probe.NodeProber``: ``sstat`` of one of our steps there, off the
loop), and when the node is still quiet at ``detect.node_silence_s`` and that probe,
started after the node's last sign of life, went unanswered, every rank of the node is
a suspect with a stale heartbeat and the slurmd verdict attached: ``decide`` makes it
NODE_LOST (``decide/classify.py``). A healthy node that is only slow (a loaded box)
answers the probe, and nothing happens; the heartbeat timeout still judges its ranks.

A quiet node whose slurmd *answered* is asked about at once: its peers probe its pulse
(``partition.PartitionWatch.about``), and when they reach it and it is still quiet at
``node_silence_s``, it is cut from the supervisor only (``NODE_PARTITIONED``), found at
the same deadline rather than at the heartbeat timeout.

When no node at all has been heard for ``node_silence_s / 2`` it is the supervisor
that is behind (its own threads starved), not every node: nothing is concluded.

Times: the newest heartbeat of the node's ranks (read once a heartbeat period) and the
newest line of its pulse (``LivenessServer.heard``, as it arrives). docs/timeouts.md.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .probe import NodeProbed

__all__ = ["probe_lead_s", "quiet_nodes", "silence"]


def probe_lead_s(silence_s: float, probe_s: float, period_s: float) -> float:
    """How long a node is quiet before its slurmd is probed (and its peers may be asked)."""
    return max(period_s, silence_s - probe_s)


def quiet_nodes(last: Mapping[str, float], now: float, *, silence_s: float, probe_s: float, period_s: float,
                verdicts: Mapping[str, NodeProbed], held: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """Pure: (nodes to probe now, nodes found silent) from each node's last sign of life.

    ``last``: node -> newest heartbeat or pulse line (0: none yet, not judged);
    ``verdicts``: the newest probe result per node; ``held``: nodes already being judged
    on stale heartbeats. A node is probed once per silence (no verdict started after its
    last sign yet; an answered one is asked again ``silence_s - probe_s`` later); it is silent when quiet for ``silence_s`` and a probe started after
    its last sign found slurmd not answering."""
    judged = {n: t for n, t in last.items() if t > 0 and n not in held}
    if len(last) > 1 and not any(now - t < silence_s / 2 for t in last.values() if t > 0):
        return [], []  # nobody heard: the observer is behind, not every node
    start_after = probe_lead_s(silence_s, probe_s, period_s)
    probe, silent = [], []
    for node, t in judged.items():
        quiet = now - t
        v = verdicts.get(node)
        # asked since its last sign of life; an answer is taken as recent only for as long
        # as the probe's lead time (a node that answered and then died is asked again)
        fresh = v is not None and v.started >= t and (v.answered is False or now - v.ended < start_after)
        if quiet >= silence_s and fresh and v.answered is False:
            silent.append(node)
        elif quiet >= start_after and not fresh:
            probe.append(node)
    return probe, silent


def silence(watch: Any, state: Any, suspects: dict[str, dict[str, Any]], now: float) -> None:
    """One look (every loop turn): start the probes of quiet nodes; hold the ranks of a
    silent node as suspects with its verdict (``watch`` is the ``Watch``: its prober,
    verdicts and held nodes, which ``Watch._probed`` hands to ``decide``)."""
    d = watch.cfg.detect
    table, by_node = watch._rank_nodes
    if table is not state.table:
        by_node = {}
        for slot in state.table.slots:
            by_node.setdefault(state.workers[slot.worker_id].node, []).append(slot.worker_id)
        watch._rank_nodes = (state.table, by_node)
    if not by_node:
        return
    heard = watch.heard()
    last = {n: max(heard.get(n, 0.0), watch._hb_heard.get(n, 0.0)) for n in by_node}
    watch._verdicts.update({r.node: r for r in watch.prober.drain()})
    probe, silent = quiet_nodes(last, now, silence_s=d.silence_s, probe_s=d.slurmd_probe_deadline_s,
                                period_s=d.heartbeat_period_s, verdicts=watch._verdicts, held=list(watch._held))
    for node in probe:
        watch.prober.start(node, [state.workers[w].step_name for w in by_node[node]])
    for node in silent:
        v = watch._verdicts[node]
        why = (f"node silent for {now - last[node]:.2f} s (no heartbeat, no pulse line) and its slurmd did "
               f"not answer ({v.detail})")
        _hold(watch, state, suspects, node, by_node[node], now, evidence=why)
    pw = watch.partition
    if pw is None or (len(last) > 1 and not any(now - t < d.silence_s / 2 for t in last.values() if t > 0)):
        return
    start_after = probe_lead_s(d.silence_s, d.slurmd_probe_deadline_s, d.heartbeat_period_s)
    for node, t in last.items():  # quiet, yet slurmd answered: do its peers still reach it?
        v = watch._verdicts.get(node)
        # asked as soon as slurmd has answered (the peers' word is in by the deadline), held only
        # once quiet for the whole deadline: a node whose link flapped back is heard before that
        if (t > 0 and node not in watch._held and now - t >= start_after and v is not None and v.answered
                and v.started >= t and (why := pw.about(node, state.watched_nodes())) and now - t >= d.silence_s):
            _hold(watch, state, suspects, node, by_node[node], now, evidence=why, peers_cut=why)


def _hold(watch: Any, state: Any, suspects: dict[str, dict[str, Any]], node: str, wids: Sequence[str],
          now: float, **why: str) -> None:
    """Hold the node's watched ranks as stale suspects with ``why`` (judged with the node's
    verdict by ``Watch._probed``)."""
    held = watch._held.setdefault(node, {})
    for wid in wids:
        if state.watched(wid):
            o = suspects.pop(wid, {"t": now})
            held[wid] = {**o, **held.get(wid, {}), "heartbeat_stale": True, **why}
