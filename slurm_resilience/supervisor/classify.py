"""Pure fault classification: observations about one rank/node → a ``Fault``.

Rules, first match wins:

======================================  ===================  ==============
observation                             slurmd reachable     kind
======================================  ===================  ==============
Slurm state DOWN/DRAIN/FAIL/NOT_RESP.   False                NODE_LOST
Slurm state DOWN/DRAIN/FAIL/NOT_RESP.   True / None          NODE_UNHEALTHY
any                                     False                NODE_LOST
process exited                          True / None          PROCESS_DIED
heartbeat stale                         True / None          PROCESS_HUNG
======================================  ===================  ==============

Anything else is not a fault: ``RecoveryError`` is raised, since the caller
should only classify when something looks wrong.
"""

from __future__ import annotations

from slurm_resilience.errors import RecoveryError
from slurm_resilience.model import Fault, FaultKind
from slurm_resilience.slurm.parse import node_state_flags

__all__ = ["classify_fault", "is_node_fault", "UNHEALTHY_FLAGS"]

UNHEALTHY_FLAGS = frozenset({"DOWN", "DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "NOT_RESPONDING"})


def _unhealthy_flags(state: str | None) -> list[str]:
    if not state:
        return []
    return sorted(node_state_flags(state) & UNHEALTHY_FLAGS)


def classify_fault(
    *,
    rank: int | None,
    node: str,
    process_exited: bool,
    slurmd_reachable: bool | None,
    heartbeat_stale: bool,
    slurm_node_state: str | None,
    now: float,
) -> Fault:
    """Classify one observation; ``detail`` says which rule fired and why.

    Args:
        slurmd_reachable: None when not probed.
        slurm_node_state: scontrol ``State=`` value (e.g. ``IDLE+DRAIN``, ``DOWN*``).

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
    elif process_exited:
        kind = FaultKind.PROCESS_DIED
        detail = "process exited (connection closed or step ended)"
    elif heartbeat_stale:
        kind = FaultKind.PROCESS_HUNG
        detail = "heartbeat stale, process not known to have exited"
    else:
        raise RecoveryError(f"no fault to classify for rank {rank} on {node}: all observations healthy")
    if kind in (FaultKind.PROCESS_DIED, FaultKind.PROCESS_HUNG):
        detail += ", node reachable" if slurmd_reachable else ", slurmd not probed"
    return Fault(kind=kind, rank=rank, node=node, time=now, detail=detail)


def is_node_fault(kind: FaultKind) -> bool:
    """True when the node itself must be replaced (NODE_LOST, NODE_UNHEALTHY)."""
    return kind in (FaultKind.NODE_LOST, FaultKind.NODE_UNHEALTHY)
