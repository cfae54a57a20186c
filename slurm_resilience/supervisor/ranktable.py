"""Pure rank-table regeneration, plus the one small function that writes it.

A rank table maps each rank to a slot (node, worker id, address). When a node
is lost, the supervisor replaces it with a spare: the new table is the old one
with the lost slots re-pointed and the generation bumped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from slurm_resilience.errors import RankTableError
from slurm_resilience.files import makedirs_private, write_private
from slurm_resilience.model import RankSlot, RankTable

__all__ = ["initial_table", "Replacement", "regenerate", "write_table", "LATEST_NAME"]

LATEST_NAME = "ranktable.json"


def initial_table(
    workers: Sequence[str],
    worker_ids: Sequence[str],
    addresses: Mapping[str, str],
    device: str = "cpu",
) -> RankTable:
    """Generation 0: rank i runs on ``workers[i]`` as ``worker_ids[i]``.

    Raises:
        RankTableError: lengths differ, a node has no address, or a node repeats.
    """
    if len(workers) != len(worker_ids):
        raise RankTableError(f"{len(workers)} worker nodes but {len(worker_ids)} worker ids")
    slots = tuple(
        RankSlot(rank=i, node=node, worker_id=wid, device=device, address=_address(addresses, node))
        for i, (node, wid) in enumerate(zip(workers, worker_ids))
    )
    return RankTable(generation=0, slots=slots)


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
    seen_new: set[str] = set()
    for rep in replacements:
        if not 0 <= rep.rank < table.world_size:
            raise RankTableError(f"replacement rank {rep.rank} is outside 0..{table.world_size - 1}")
        if rep.rank in seen_ranks:
            raise RankTableError(f"rank {rep.rank} is replaced twice")
        if rep.new_node in seen_new:
            raise RankTableError(f"node {rep.new_node!r} is the new node of two replacements")
        seen_ranks.add(rep.rank)
        seen_new.add(rep.new_node)
        current = table.slots[rep.rank]
        if current.node != rep.old_node:
            raise RankTableError(
                f"rank {rep.rank} runs on {current.node!r}, not {rep.old_node!r}"
            )
        holder = table.slot_for_node(rep.new_node)
        # Only a restart in place may reuse a node of the table: ranks never
        # move between nodes, so a vacated node is not offered to another rank.
        if holder is not None and holder.rank != rep.rank:
            raise RankTableError(f"node {rep.new_node!r} already runs rank {holder.rank}")
        if rep.new_node == rep.old_node and rep.new_worker_id == current.worker_id:
            raise RankTableError(f"restart of rank {rep.rank} in place needs a new worker id")
        slots[rep.rank] = replace(
            current,
            node=rep.new_node,
            worker_id=rep.new_worker_id,
            address=_address(addresses, rep.new_node),
        )
    return RankTable(generation=table.generation + 1, slots=tuple(slots))


def write_table(table: RankTable, directory: str) -> str:
    """Write ``ranktable-gen{g:04d}.json`` and ``ranktable.json`` atomically.

    Each file is written to a 0600 temp file in ``directory``, fsynced, renamed
    into place, and the directory is fsynced. The versioned file lands first so
    ``ranktable.json`` never names a generation that is not on disk.

    Returns:
        the path of the versioned file.
    Raises:
        OSError: the directory is not writable.
    """
    makedirs_private(directory)
    text = table.to_json()
    path = os.path.join(directory, f"ranktable-gen{table.generation:04d}.json")
    write_private(path, text)
    write_private(os.path.join(directory, LATEST_NAME), text)
    return path


def _address(addresses: Mapping[str, str], node: str) -> str:
    try:
        return addresses[node]
    except KeyError:
        raise RankTableError(f"no address known for node {node!r}") from None


def shrink(table: RankTable, lost_ranks: Sequence[int]) -> RankTable:
    """Scale-in: drop the lost ranks; survivors keep their order and are renumbered.

        generation 5                      generation 6
        rank 0  n1  w-a                   rank 0  n1  w-a
        rank 1  n2  w-b   -- lost -->
        rank 2  n3  w-c                   rank 1  n3  w-c
        rank 3  n4  w-d                   rank 2  n4  w-d

    Raises:
        RankTableError: a lost rank is out of range, or nobody would remain.
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


def grow(table: RankTable, node: str, worker_id: str, addresses: Mapping[str, str]) -> RankTable:
    """Scale back out: a returned node joins as the next rank (survivors keep theirs).

    Raises:
        RankTableError: the node already holds a rank or has no address.
    """
    if table.slot_for_node(node) is not None:
        raise RankTableError(f"node {node!r} already runs rank {table.slot_for_node(node).rank}")
    slot = RankSlot(rank=table.world_size, node=node, worker_id=worker_id,
                    address=_address(addresses, node))
    return RankTable(generation=table.generation + 1, slots=(*table.slots, slot))
