"""Pure rank-table regeneration (its file is written by ``adapters/publish.py``).

A rank table maps each rank to a slot (node, worker id, address). When a node
is lost, the supervisor replaces it with a spare: the new table is the old one
with the lost slots re-pointed and the generation bumped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from slurm_resilience.errors import RankTableError
from slurm_resilience.model import RankSlot, RankTable

__all__ = ["initial_table", "slot_device", "Replacement", "regenerate", "shrink", "grow"]



def initial_table(
    workers: Sequence[str],
    worker_ids: Sequence[str],
    addresses: Mapping[str, str],
    device: str = "cpu",
    tasks_per_node: int = 1,
) -> RankTable:
    """Generation 0: node i of ``workers`` holds ranks ``i*G .. i*G+G-1`` (G =
    ``tasks_per_node``), rank r running as ``worker_ids[r]``. A rank's device is
    ``cuda:LOCAL_RANK`` on GPUs (``device="cuda"``), else ``device``.

    Raises:
        RankTableError: lengths differ, a node has no address, or a node repeats.
    """
    if tasks_per_node < 1:
        raise RankTableError(f"tasks_per_node={tasks_per_node} must be >= 1")
    if len(workers) * tasks_per_node != len(worker_ids):
        raise RankTableError(f"{len(workers)} worker nodes x {tasks_per_node} tasks but {len(worker_ids)} worker ids")
    if len(set(workers)) != len(workers):
        raise RankTableError(f"a worker node repeats in {list(workers)}")
    slots = tuple(
        RankSlot(rank=i, node=workers[i // tasks_per_node], worker_id=wid, local_rank=i % tasks_per_node,
                 device=slot_device(device, i % tasks_per_node),
                 address=_address(addresses, workers[i // tasks_per_node]))
        for i, wid in enumerate(worker_ids)
    )
    return RankTable(generation=0, slots=slots)


def slot_device(device: str, local_rank: int) -> str:
    """``cuda`` → ``cuda:LOCAL_RANK`` (one GPU per rank); anything else as it is."""
    return f"cuda:{local_rank}" if device == "cuda" else device


@dataclass(frozen=True)
class Replacement:
    """Rank ``rank`` moves from ``old_node`` to ``new_node`` as ``new_worker_id``.

    ``new_node == old_node`` with a fresh worker id is a restart in place.
    """

    rank: int
    old_node: str
    new_node: str
    new_worker_id: str


def regenerate(
    table: RankTable,
    replacements: Sequence[Replacement],
    addresses: Mapping[str, str],
) -> RankTable:
    """Next generation: replaced ranks keep their number on a new node.

    Ranks never move; survivors keep their node and worker id::

        generation 3                      generation 4
        rank 0  n1  w-a                   rank 0  n1  w-a
        rank 1  n2  w-b   -- n2 lost -->  rank 1  n5  w-e   (spare n5)
        rank 2  n3  w-c                   rank 2  n3  w-c
        rank 3  n4  w-d   -- restart -->  rank 3  n4  w-f   (same node, new process)

    Raises:
        RankTableError: a replacement's rank is out of range or its ``old_node``
            is not that rank's node; a new node already holds another rank; two
            replacements share a rank or a new node; a new node has no address.
    """
    slots = list(table.slots)
    seen_ranks: set[int] = set()
    moved_from: dict[str, str] = {}  # new node -> the one old node whose ranks move there
    for rep in replacements:
        if not 0 <= rep.rank < table.world_size:
            raise RankTableError(f"replacement rank {rep.rank} is outside 0..{table.world_size - 1}")
        if rep.rank in seen_ranks:
            raise RankTableError(f"rank {rep.rank} is replaced twice")
        seen_ranks.add(rep.rank)
        current = table.slots[rep.rank]
        if current.node != rep.old_node:
            raise RankTableError(
                f"rank {rep.rank} runs on {current.node!r}, not {rep.old_node!r}"
            )
        if moved_from.setdefault(rep.new_node, rep.old_node) != rep.old_node:
            raise RankTableError(f"node {rep.new_node!r} is the new node of ranks from two nodes")
        # Only a restart in place may reuse a node of the table: ranks never
        # move between nodes, so a vacated node is not offered to another rank.
        held = table.ranks_on(rep.new_node)
        if held and rep.new_node != rep.old_node:
            raise RankTableError(f"node {rep.new_node!r} already runs rank {held[0]}")
        if rep.new_node == rep.old_node and rep.new_worker_id == current.worker_id:
            raise RankTableError(f"restart of rank {rep.rank} in place needs a new worker id")
        slots[rep.rank] = replace(
            current,
            node=rep.new_node,
            worker_id=rep.new_worker_id,
            address=_address(addresses, rep.new_node),
        )
    # a node's ranks move together (a partial move breaks the table's node invariant)
    return RankTable(generation=table.generation + 1, slots=tuple(slots))


def _address(addresses: Mapping[str, str], node: str) -> str:
    try:
        return addresses[node]
    except KeyError:
        raise RankTableError(f"no address known for node {node!r}") from None


def shrink(table: RankTable, lost_ranks: Sequence[int]) -> RankTable:
    """Scale-in: drop the lost ranks (whole nodes); survivors keep their order and
    local ranks and are renumbered.

        generation 5                      generation 6
        rank 0  n1  w-a                   rank 0  n1  w-a
        rank 1  n2  w-b   -- lost -->
        rank 2  n3  w-c                   rank 1  n3  w-c
        rank 3  n4  w-d                   rank 2  n4  w-d

    Raises:
        RankTableError: a lost rank is out of range, a node would keep only some of its
            ranks, or nobody would remain.
    """
    lost = set(lost_ranks)
    for r in lost:
        if not 0 <= r < table.world_size:
            raise RankTableError(f"lost rank {r} is outside 0..{table.world_size - 1}")
    keep = [s for s in table.slots if s.rank not in lost]
    if not keep:
        raise RankTableError("scale-in would leave no rank")
    slots = tuple(replace(s, rank=i) for i, s in enumerate(keep))
    return RankTable(generation=table.generation + 1, slots=slots)


def grow(table: RankTable, node: str, worker_ids: Sequence[str], addresses: Mapping[str, str],
         device: str = "cpu") -> RankTable:
    """Scale back out: a returned node joins as the next node index, its G ranks last
    (survivors keep theirs). ``worker_ids``: one per local rank.

    Raises:
        RankTableError: the node already holds a rank, has no address, or the number of
            worker ids is not the table's ranks per node.
    """
    if table.ranks_on(node):
        raise RankTableError(f"node {node!r} already runs rank {table.ranks_on(node)[0]}")
    if table.world_size and len(worker_ids) != table.tasks_per_node:
        raise RankTableError(f"{len(worker_ids)} worker ids for a node of {table.tasks_per_node} ranks")
    new = tuple(RankSlot(rank=table.world_size + l, node=node, worker_id=wid, local_rank=l,
                         device=slot_device(device, l), address=_address(addresses, node))
                for l, wid in enumerate(worker_ids))
    return RankTable(generation=table.generation + 1, slots=(*table.slots, *new))


def in_node_order(table: RankTable, order: Sequence[str]) -> RankTable:
    """The same placement with nodes in ``order`` (ranks renumbered node-major, local
    ranks kept). Relaunch mode: Slurm numbers a step's tasks in allocation order whatever
    the order of ``-w``, so the table must say what Slurm will do.

    Raises:
        RankTableError: a node of the table is not in ``order``.
    """
    missing = [n for n in table.node_list if n not in order]
    if missing:
        raise RankTableError(f"node(s) {missing} not in the allocation order")
    nodes = sorted(table.node_list, key=list(order).index)
    slots = [table.slots[r] for n in nodes for r in table.ranks_on(n)]
    return RankTable(generation=table.generation, slots=tuple(replace(s, rank=i) for i, s in enumerate(slots)))
