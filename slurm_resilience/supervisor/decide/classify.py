"""Pure fault classification: observations about one rank/node → a ``Fault``.

Rules, first match wins:

======================================  ===================  ==============
observation                             slurmd reachable     kind
======================================  ===================  ==============
Slurm state DOWN/DRAIN/FAIL/NOT_RESP.   False                NODE_LOST
Slurm state DOWN/DRAIN/FAIL/NOT_RESP.   True / None          NODE_UNHEALTHY
any                                     False                NODE_LOST
heartbeat stale, node silent            no Slurm answer      NODE_LOST
node cut from its peers (peer probes)   True / None          NODE_PARTITIONED
process exited                          True / None          PROCESS_DIED
heartbeat stale                         True / None          PROCESS_HUNG
======================================  ===================  ==============

"slurmd reachable" is a TCP connect to slurmd's port; a stopped or hung slurmd
still accepts one. "No Slurm answer" (``slurmd_answers`` False) is the silent-node
probe (``probe.py``): every worker on the node was heartbeat-stale and the node's
slurmd did not answer a step-stat request within ``detect.slurmd_probe_deadline_s``.

Anything else is not a fault: ``RecoveryError`` is raised, since the caller
should only classify when something looks wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from slurm_resilience.errors import RecoveryError
from slurm_resilience.model import Fault, FaultKind
from slurm_resilience.slurm.parse import compress_hostlist, node_state_flags

__all__ = ["classify_fault", "find_faults", "is_node_fault", "lost_nodes", "node_unhealthy", "UNHEALTHY_FLAGS"]

UNHEALTHY_FLAGS = frozenset({"DOWN", "DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "NOT_RESPONDING"})


def _unhealthy_flags(state: str | None) -> list[str]:
    if not state:
        return []
    return sorted(node_state_flags(state) & UNHEALTHY_FLAGS)


def node_unhealthy(state: str | None) -> bool:
    """The one health check of a Slurm node state (``IDLE+DRAIN``, ``DOWN*``, ...): True
    when any flag in ``UNHEALTHY_FLAGS`` is set. Used for ranks, spares and returning nodes."""
    return bool(_unhealthy_flags(state))


def classify_fault(
    *,
    rank: int | None,
    node: str,
    process_exited: bool,
    slurmd_reachable: bool | None,
    heartbeat_stale: bool,
    slurm_node_state: str | None,
    now: float,
    slurmd_answers: bool | None = None,
    peers_cut: str = "",
) -> Fault:
    """Classify one observation; ``detail`` says which rule fired and why.

    Args:
        slurmd_reachable: None when not probed.
        slurm_node_state: scontrol ``State=`` value (e.g. ``IDLE+DRAIN``, ``DOWN*``).
        slurmd_answers: the silent-node probe (None: not asked).
        peers_cut: the evidence that the node is cut from its peers ("" when none).

    Raises:
        RecoveryError: nothing in the observation indicates a fault.
    """
    bad = _unhealthy_flags(slurm_node_state)
    if bad:
        if slurmd_reachable is False:
            kind = FaultKind.NODE_LOST
            detail = f"slurm state {slurm_node_state} and slurmd unreachable"
        else:
            kind = FaultKind.NODE_UNHEALTHY
            detail = f"slurm state {slurm_node_state} ({'+'.join(bad)})"
    elif slurmd_reachable is False:
        kind = FaultKind.NODE_LOST
        detail = "slurmd unreachable"
    elif slurmd_answers is False and heartbeat_stale and not process_exited:
        kind = FaultKind.NODE_LOST
        detail = "every rank on the node silent and slurmd did not answer a Slurm request in time"
    elif peers_cut and not process_exited:
        kind, detail = FaultKind.NODE_PARTITIONED, peers_cut
    elif process_exited:
        kind = FaultKind.PROCESS_DIED
        detail = "process exited (connection closed or step ended)"
    elif heartbeat_stale:
        kind = FaultKind.PROCESS_HUNG
        detail = "heartbeat stale, process not known to have exited"
    else:
        raise RecoveryError(f"no fault to classify for rank {rank} on {node}: all observations healthy")
    if kind in (FaultKind.PROCESS_DIED, FaultKind.PROCESS_HUNG):
        detail += (", slurmd answered" if slurmd_answers else ", node reachable" if slurmd_reachable
                   else ", slurmd not probed")
    return Fault(kind=kind, rank=rank, node=node, time=now, detail=detail)


def is_node_fault(kind: FaultKind) -> bool:
    """True when the node itself must be replaced (NODE_LOST, NODE_UNHEALTHY, NODE_PARTITIONED)."""
    return kind in (FaultKind.NODE_LOST, FaultKind.NODE_UNHEALTHY, FaultKind.NODE_PARTITIONED)


def lost_nodes(nodes: Sequence[str], reachable: Mapping[str, bool | None], states: Mapping[str, str]) -> list[str]:
    """Pure: the nodes whose fault is the node's own (slurmd unreachable, or unhealthy in
    Slurm: down, not responding — a frozen node still takes the probe's connect). Nothing
    on a recovery's path waits on them (a warm kill skips their zygotes)."""
    return [n for n in nodes if reachable.get(n) is False or node_unhealthy(states.get(n))]


def find_faults(nodes: Sequence[str], *, exit_code: int | None, reachable: Mapping[str, bool | None],
                states: Mapping[str, str], now: float) -> list[Fault]:
    """Classify what was observed about one all-ranks step on ``nodes`` (relaunch mode).

    Every unreachable or unhealthy node is a node fault; otherwise a non-zero exit
    is one PROCESS_DIED fault of the whole step (which rank is unknown). A clean
    exit on healthy nodes, or a running step on healthy nodes, is no fault.
    """
    faults = []
    for node in lost_nodes(nodes, reachable, states):
        faults.append(classify_fault(rank=None, node=node, process_exited=exit_code is not None,
                                     slurmd_reachable=reachable.get(node), heartbeat_stale=False,
                                     slurm_node_state=states.get(node), now=now))
    if not faults and exit_code not in (None, 0):
        fault = classify_fault(rank=None, node=compress_hostlist(nodes), process_exited=True,
                               slurmd_reachable=True, heartbeat_stale=False, slurm_node_state=None, now=now)
        faults.append(dataclasses.replace(fault, detail=f"{fault.detail}; step exit code {exit_code}"))
    return faults
