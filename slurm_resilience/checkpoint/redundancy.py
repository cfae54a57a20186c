"""Node-loss redundancy for node-local checkpoints: who holds which copy or parity row.

Pure functions over rank -> node lists and group indices; the byte arithmetic is
in ``xor_math``, and the engine moves the bytes.

PARTNER: rank r also stores a full copy of rank ``partner_sources(r)``'s shards;
its own copy lives with :func:`partner_of` ``(r)``: the rank with the same local
index on the next node (nodes in order of first appearance, cyclic). With G ranks
on every node each rank holds exactly one copy, never one of its own node's::

    nodes  a a | b b | c c          rank 0 -> 2, 1 -> 3, 2 -> 4, 3 -> 5, 4 -> 0, 5 -> 1
    ranks  0 1 | 2 3 | 4 5          (one rank per node: r -> r + 1, cyclic)

XOR (SCR-style RAID-5): :func:`xor_groups` splits the ranks into groups whose
members sit on distinct nodes. In a group of n members every shard is zero-padded
to ``(n-1) * S`` bytes (``S`` = ceil(longest / (n-1)), rounded up to 8) and cut
into n-1 segments. Segment j of member m belongs to parity row ``(m + 1 + j) % n``;
row r is the XOR of one segment of every member except r, and member r stores it.
For n = 4 (``Dm.j`` = segment j of member m, ``P r`` stored by member r)::

    row 0: P0 = D1.2 ^ D2.1 ^ D3.0      member 0 stores P0
    row 1: P1 = D0.0 ^ D2.2 ^ D3.1      member 1 stores P1
    row 2: P2 = D0.1 ^ D1.0 ^ D3.2      member 2 stores P2
    row 3: P3 = D0.2 ^ D1.1 ^ D2.0      member 3 stores P3

Losing member x loses its shard and P x; each of its segments is in a row r != x
whose parity and other segments survive, so the shard is rebuilt exactly, then
P x is recomputed. Cost per member: one parity block of S ~ longest / (n-1) bytes
(PARTNER costs a full shard). Two lost members in one group cannot be rebuilt.
With n = 2 the parity is the other member's shard, i.e. PARTNER.

The engine (``xor_tier``, ``xor_rebuild``) encodes with one all-to-all: member m
sends member r its segment :func:`segment_in_row` ``(m, r)``, and r XORs what it
receives into row r. To rebuild member x, each survivor sends the n pieces
:func:`rebuild_sources` names; their XOR is x's segments and its parity row.
"""

from __future__ import annotations

from typing import Sequence

from slurm_resilience.errors import CheckpointError

__all__ = [
    "ranks_by_node",
    "partner_map",
    "partner_of",
    "partner_sources",
    "xor_groups",
    "xor_parity_holder",
    "segment_row",
    "segment_in_row",
    "rebuild_sources",
]

# -- PARTNER -----------------------------------------------------------------


def _check_rank(rank: int, nodes: Sequence[str]) -> None:
    if not 0 <= rank < len(nodes):
        raise CheckpointError(f"rank {rank} is not in 0..{len(nodes) - 1}")


def ranks_by_node(nodes: Sequence[str]) -> dict[str, list[int]]:
    """node -> its ranks ascending, nodes in order of first appearance (``nodes[r]``: rank r's node)."""
    out: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        out.setdefault(node, []).append(r)
    return out


def partner_map(nodes: Sequence[str]) -> list[int]:
    """Pure: ``out[r]`` is the rank holding rank r's PARTNER copy, always on another node.

    Local index k of node i sends to local index ``k mod G'`` of node i+1 (cyclic),
    G' being that node's rank count: a bijection when every node has the same count.

    Raises:
        CheckpointError: every rank is on one node (no partner exists).
    """
    by_node = list(ranks_by_node(nodes).values())
    if len(by_node) < 2:
        raise CheckpointError(
            f"PARTNER redundancy needs ranks on at least 2 nodes; all {len(nodes)} ranks are on {nodes[0]!r}"
            if nodes else "PARTNER redundancy needs ranks on at least 2 nodes; there are no ranks")
    out = [0] * len(nodes)
    for i, ranks in enumerate(by_node):
        nxt = by_node[(i + 1) % len(by_node)]
        for k, r in enumerate(ranks):
            out[r] = nxt[k % len(nxt)]
    return out


def partner_of(rank: int, nodes: Sequence[str]) -> int:
    """The rank whose node holds ``rank``'s partner copy (:func:`partner_map`).

    Raises:
        CheckpointError: rank out of range, or every rank is on one node.
    """
    _check_rank(rank, nodes)
    return partner_map(nodes)[rank]


def partner_sources(rank: int, nodes: Sequence[str]) -> list[int]:
    """Ranks whose partner copies ``rank`` holds (the inverse of :func:`partner_of`), ascending.

    Raises:
        CheckpointError: as :func:`partner_of`.
    """
    _check_rank(rank, nodes)
    return [r for r, p in enumerate(partner_map(nodes)) if p == rank]


# -- XOR groups ----------------------------------------------------------------


def xor_groups(nodes: Sequence[str], group_size: int) -> list[list[int]]:
    """Partition ranks into XOR groups whose members are on distinct nodes. Deterministic.

    Groups have ``group_size`` members, except the last one which takes the
    remainder (>= 2); when the remainder would be 1 that rank joins the last
    group instead (``group_size + 1`` members), as SCR merges too small a set.
    Each group is filled from the nodes with the most ungrouped ranks (ties: the
    node seen first), the lowest rank of each, so one rank per node gives
    consecutive ranks and k ranks per node groups equal local ranks.
    Groups are returned sorted, members ascending.

    Raises:
        CheckpointError: group_size < 2, fewer than 2 ranks, or no such partition
            (too few nodes for a group, or one node holding too many ranks).
    """
    if group_size < 2:
        raise CheckpointError(f"XOR group_size={group_size} must be >= 2")
    total = len(nodes)
    if total < 2:
        raise CheckpointError(f"XOR needs at least 2 ranks, got {total}")
    sizes = [group_size] * (total // group_size)
    rest = total % group_size
    if rest >= 2 or not sizes:
        sizes.append(rest)
    elif rest == 1:
        sizes[-1] += 1
    order = ranks_by_node(nodes)
    seen = {node: i for i, node in enumerate(order)}  # first-appearance order
    left = {node: list(ranks) for node, ranks in order.items()}
    groups: list[list[int]] = []
    for size in sizes:
        ready = sorted((n for n in order if left[n]), key=lambda n: (-len(left[n]), seen[n]))
        if len(ready) < size:
            busiest = max(order, key=lambda n: len(order[n]))
            raise CheckpointError(
                f"cannot form XOR groups of {size} ranks on distinct nodes: {total} ranks on "
                f"{len(order)} node(s), {len(order[busiest])} on {busiest!r}; lower group_size or use PARTNER"
            )
        groups.append(sorted(left[n].pop(0) for n in ready[:size]))
    return sorted(groups)


def xor_parity_holder(group: Sequence[int], row: int) -> int:
    """The rank that stores parity row ``row`` of ``group``: member ``row`` itself.

    Raises:
        CheckpointError: row not in 0..len(group)-1.
    """
    if not 0 <= row < len(group):
        raise CheckpointError(f"parity row {row} is not in 0..{len(group) - 1}")
    return group[row]


def segment_row(member: int, segment: int, n: int) -> int:
    """The parity row that covers segment ``segment`` of member ``member`` in a group of n."""
    return (member + 1 + segment) % n


def segment_in_row(member: int, row: int, n: int) -> int:
    """Which segment of ``member`` parity row ``row`` covers (inverse of :func:`segment_row`).

    Raises:
        CheckpointError: ``row == member`` (a member has no segment in its own row).
    """
    if row % n == member % n:
        raise CheckpointError(f"member {member} has no segment in its own parity row")
    return (row - member - 1) % n


def rebuild_sources(member: int, missing: int, n: int) -> list[int | None]:
    """What survivor ``member`` sends to rebuild member ``missing``: n pieces of S bytes.

    Piece j < n-1 serves segment j of the lost shard, whose parity row is
    ``r = segment_row(missing, j, n)``: the survivor's own parity row when it holds
    row r (None), else its segment in row r. Piece n-1 is its segment in row
    ``missing``, for recomputing the lost parity row. XORed over all survivors, the
    pieces are the lost shard's n-1 segments followed by its parity row::

        D_missing.j = P_r ^ XOR(D_m.segment_in_row(m, r) for m not in {r, missing})
        P_missing   =       XOR(D_m.segment_in_row(m, missing) for m != missing)

    Raises:
        CheckpointError: fewer than 2 members, or member/missing out of range or equal.
    """
    if n < 2:
        raise CheckpointError(f"an XOR group needs at least 2 members, got {n}")
    if not (0 <= member < n and 0 <= missing < n) or member == missing:
        raise CheckpointError(f"survivor {member} and lost member {missing} must differ and be in 0..{n - 1}")
    pieces: list[int | None] = []
    for j in range(n - 1):
        row = segment_row(missing, j, n)
        pieces.append(None if row == member else segment_in_row(member, row, n))
    pieces.append(segment_in_row(member, missing, n))
    return pieces
