"""Pure spare choice: which spare node takes over a failed node's ranks.

Isolating the bad node (``scontrol update ... state=DOWN``) is done by the
supervisor loop through ``slurm.commands``; this module only decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

__all__ = ["SparePlan", "choose_spare", "choose_spares"]


@dataclass(frozen=True)
class SparePlan:
    """The chosen spare (``node``), or ``node=None`` and ``reason`` why none fits."""

    node: str | None
    reason: str


def choose_spare(
    spares: Sequence[str],
    excluded: Collection[str],
    failed_node: str,
    preferred: Sequence[str] = (),
) -> SparePlan:
    """First usable spare: ``preferred`` ones first, then in job order.

    A spare is usable when it is not in ``excluded`` (already used, isolated or
    known bad) and is not ``failed_node`` itself.
    """
    pref = [s for s in preferred if s in spares]
    order = pref + [s for s in spares if s not in pref]
    for node in order:
        if node not in excluded and node != failed_node:
            why = "preferred spare" if node in pref else "first free spare in job order"
            return SparePlan(node=node, reason=f"{why} {node} replaces {failed_node}")
    used = sorted(s for s in spares if s in excluded or s == failed_node)
    return SparePlan(
        node=None,
        reason=(
            f"no spare left: {len(spares)} spare(s) in the job, all used or excluded"
            f" ({', '.join(used) if used else 'none'})"
        ),
    )


def choose_spares(
    spares: Sequence[str],
    excluded: Collection[str],
    failed_nodes: Sequence[str],
) -> dict[str, str | None]:
    """Map each failed node to a distinct spare (None once spares run out).

    Failed nodes are served in the order given; failed nodes are never chosen.
    """
    taken = set(excluded) | set(failed_nodes)
    result: dict[str, str | None] = {}
    for failed in failed_nodes:
        plan = choose_spare(spares, taken, failed)
        result[failed] = plan.node
        if plan.node is not None:
            taken.add(plan.node)
    return result
