"""Pure decisions of the ULFM repair: who takes which rank, where state comes from.

Nothing here calls MPI. ``mpi/ulfm.py`` gathers one ``Member`` per surviving process
(over the shrunk world) and carries out the ``RepairPlan`` this module returns.

Spares are the world's last ranks. A lost active rank is taken by the first spare
left; survivors keep their ranks. When the spares run out, the lost numbers are
closed up (scale-in): survivors keep their order, the world gets smaller::

    before   active 0 1 2 3 | spare s4        rank 2 lost, s4 takes it
    after    active 0 1 s4 3                  (survivors keep 0, 1, 3)

    before   active 0 1 2 3 | (no spare)      rank 2 lost: scale-in
    after    active 0 1 3 -> new ranks 0 1 2

Each active rank ``r`` keeps a copy of its state on its *buddy* ``buddy(r)``, a rank
on another node; a replacement is restored from the buddy's copy of the step every
surviving active rank completed (the rollback step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .errors import StateLostError

__all__ = ["SPARE", "Member", "RepairPlan", "buddy", "buddy_source", "rollback_step", "plan_repair"]

SPARE = -1
"""``Member.rank`` of a parked spare (it holds no rank of the working communicator)."""


@dataclass(frozen=True)
class Member:
    """What one surviving process says about itself when the repair gathers.

    Attributes:
        wid: its rank in the original ``COMM_WORLD`` (stable for the whole run).
        rank: its rank in the working communicator before the fault, or ``SPARE``.
        committed: the last step whose state it has committed (buddy copies included);
            -1 for a spare.
    """

    wid: int
    rank: int
    committed: int


@dataclass(frozen=True)
class RepairPlan:
    """The outcome of one repair, identical on every surviving process.

    Attributes:
        size: the working communicator's size after the repair.
        new_rank: ``wid -> new rank`` for every process that is active afterwards
            (a spare left parked is absent).
        promoted: ``wid -> old rank it takes`` for every spare that takes a lost rank.
        lost: the old ranks no survivor held.
        step: the rollback step: the last step every surviving active rank committed.
        sources: ``new rank -> new rank of the holder`` of the state each promoted
            spare is restored from (its buddy's copy of the lost rank's state).
        scaled_in: the old ranks dropped because no spare was left.
    """

    size: int
    new_rank: Mapping[int, int]
    promoted: Mapping[int, int]
    lost: tuple[int, ...]
    step: int
    sources: Mapping[int, int] = field(default_factory=dict)
    scaled_in: tuple[int, ...] = ()

    def rank_of(self, wid: int) -> int:
        """The new rank of ``wid``, or ``SPARE`` when it stays parked."""
        return self.new_rank.get(wid, SPARE)


def buddy(rank: int, size: int, per_node: int) -> int:
    """The rank that holds a copy of ``rank``'s state: ``per_node`` ranks further on.

    With ranks laid out node by node (``per_node`` consecutive ranks per node), that
    rank is on the next node. With one node only (``size <= per_node``) there is no
    other node and the copy sits on the next rank.
    """
    if size < 1 or not 0 <= rank < size or per_node < 1:
        raise ValueError(f"no buddy for rank {rank} of {size} ({per_node} per node)")
    offset = per_node if size > per_node else 1
    return (rank + offset) % size


def buddy_source(rank: int, size: int, per_node: int) -> int:
    """The rank whose state ``rank`` holds a copy of (the inverse of ``buddy``)."""
    if size < 1 or not 0 <= rank < size or per_node < 1:
        raise ValueError(f"no buddy for rank {rank} of {size} ({per_node} per node)")
    offset = per_node if size > per_node else 1
    return (rank - offset) % size


def rollback_step(members: Sequence[Member]) -> int:
    """The last step every surviving active rank has committed (-1: none is active)."""
    steps = [m.committed for m in members if m.rank != SPARE]
    return min(steps) if steps else -1


def plan_repair(members: Sequence[Member], size: int, per_node: int) -> RepairPlan:
    """Decide the working communicator after a fault.

    ``members`` are the surviving processes (any order), ``size`` the working size
    before the fault, ``per_node`` the buddy distance used before the fault.

    Raises:
        StateLostError: a lost rank is to be replaced but its buddy is lost too,
            or no active rank survived.
    """
    wids = [m.wid for m in members]
    if len(set(wids)) != len(wids):
        raise ValueError(f"duplicate world ranks among the survivors: {sorted(wids)}")
    by_rank = {m.rank: m for m in members if m.rank != SPARE}
    if any(not 0 <= r < size for r in by_rank):
        raise ValueError(f"a survivor claims a rank outside 0..{size - 1}: {sorted(by_rank)}")
    if not by_rank:
        raise StateLostError("every active rank is lost: no state survives to restore from")
    spares = sorted(m.wid for m in members if m.rank == SPARE)
    lost = tuple(r for r in range(size) if r not in by_rank)

    holder: dict[int, int] = {}  # old rank -> wid of the process that has it now
    promoted: dict[int, int] = {}
    for r in lost:
        if not spares:
            break
        wid = spares.pop(0)
        holder[r] = wid
        promoted[wid] = r
    for r, m in by_rank.items():
        holder[r] = m.wid
    scaled_in = tuple(r for r in lost if r not in holder)

    kept = sorted(holder)  # old ranks kept, in order: survivors keep theirs when nothing is dropped
    new_of_old = {old: new for new, old in enumerate(kept)}
    new_rank = {holder[old]: new_of_old[old] for old in kept}

    sources: dict[int, int] = {}
    for wid, old in promoted.items():
        src_old = buddy(old, size, per_node)
        if src_old not in by_rank:
            raise StateLostError(
                f"rank {old} and the buddy holding its state (rank {src_old}) are both lost")
        sources[new_of_old[old]] = new_of_old[src_old]
    return RepairPlan(size=len(kept), new_rank=new_rank, promoted=promoted, lost=lost,
                      step=rollback_step(members), sources=sources, scaled_in=scaled_in)
