"""Node-loss redundancy for node-local checkpoints: PARTNER copies and XOR parity.

Pure functions over rank -> node lists and byte strings; the engine moves the bytes.

PARTNER: rank r also stores a full copy of rank ``partner_sources(r)``'s shards;
its own copy lives with :func:`partner_of` ``(r)``, the next rank on another node.

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
:func:`member_rows` is one member's share of the encoding as a matrix, for a
collective bitwise-XOR reduce-scatter. :func:`encode_group` / :func:`rebuild` are
the same XOR over whole shards, for a parity kept off the group (one block ~ the
longest shard).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import numpy as np

from slurm_resilience.errors import CheckpointError

__all__ = [
    "partner_of",
    "partner_sources",
    "xor_groups",
    "xor_encode",
    "ParityBlock",
    "encode_group",
    "rebuild",
    "encode_group_distributed",
    "member_rows",
    "rebuild_distributed",
    "xor_parity_holder",
    "segment_row",
    "segment_in_row",
    "segment_size",
    "rebuild_sources",
    "xor_into",
    "strip_padding",
]

Chunk = Union[bytes, bytearray, memoryview, np.ndarray]


# -- PARTNER -----------------------------------------------------------------


def _check_rank(rank: int, nodes: Sequence[str]) -> None:
    if not 0 <= rank < len(nodes):
        raise CheckpointError(f"rank {rank} is not in 0..{len(nodes) - 1}")


def partner_of(rank: int, nodes: Sequence[str]) -> int:
    """The rank whose node holds ``rank``'s partner copy: the next rank (cyclic) on another node.

    ``nodes[r]`` is the host of rank r.

    Raises:
        CheckpointError: rank out of range, or every rank is on one node.
    """
    _check_rank(rank, nodes)
    n = len(nodes)
    for k in range(1, n):
        other = (rank + k) % n
        if nodes[other] != nodes[rank]:
            return other
    raise CheckpointError(
        f"PARTNER redundancy needs ranks on at least 2 nodes; all {n} ranks are on {nodes[rank]!r}"
    )


def partner_sources(rank: int, nodes: Sequence[str]) -> list[int]:
    """Ranks whose partner copies ``rank`` holds (the inverse of :func:`partner_of`), ascending.

    Raises:
        CheckpointError: as :func:`partner_of`.
    """
    _check_rank(rank, nodes)
    return [r for r in range(len(nodes)) if partner_of(r, nodes) == rank]


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
    order: dict[str, list[int]] = {}
    for r, node in enumerate(nodes):
        order.setdefault(node, []).append(r)
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


# -- XOR arithmetic ------------------------------------------------------------


def _u8(chunk: Chunk) -> np.ndarray:
    if isinstance(chunk, np.ndarray):
        return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    return np.frombuffer(chunk, dtype=np.uint8)


def xor_into(acc: np.ndarray, src: np.ndarray) -> None:
    """acc[:len(src)] ^= src for uint8 arrays, in place, 8 bytes at a time where possible."""
    n = len(src)
    k = n - n % 8
    if k:
        dst = acc[:k].view(np.uint64)
        np.bitwise_xor(dst, src[:k].view(np.uint64), out=dst)
    if n > k:
        tail = acc[k:n]
        np.bitwise_xor(tail, src[k:n], out=tail)


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def xor_encode(chunks: Sequence[Chunk]) -> np.ndarray:
    """XOR of byte strings of different lengths, zero-padded to the longest (uint8 array).

    The caller must record the lengths to rebuild (see :func:`encode_group`).
    """
    arrays = [_u8(c) for c in chunks]
    longest = max((len(a) for a in arrays), default=0)
    acc = np.zeros(_round8(longest), dtype=np.uint8)
    for a in arrays:
        xor_into(acc, a)
    return acc[:longest]


@dataclass(frozen=True, kw_only=True, eq=False)
class ParityBlock:
    """A parity block and the byte lengths of the group's shards, in member order.

    Fields:
        parity: uint8 parity bytes (whole-shard parity, or one row of the distributed layout).
        lengths: length of each member's shard; needed to strip the zero padding.
    """

    parity: np.ndarray
    lengths: tuple[int, ...]

    _MAGIC = b"SRXOR01\0"

    def to_bytes(self) -> bytes:
        """Self-describing serialization: magic, member count, lengths, parity."""
        n = len(self.lengths)
        head = struct.pack(f"<8sQ{n}QQ", self._MAGIC, n, *self.lengths, len(self.parity))
        return head + self.parity.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> ParityBlock:
        """Inverse of :meth:`to_bytes`.

        Raises:
            CheckpointError: the bytes are not a complete parity block.
        """
        if len(data) < 16 or data[:8] != cls._MAGIC:
            raise CheckpointError("not a parity block (bad magic)")
        (n,) = struct.unpack_from("<Q", data, 8)
        end = 16 + 8 * n + 8
        if len(data) < end:
            raise CheckpointError(f"parity block truncated: {len(data)} bytes, header needs {end}")
        lengths = struct.unpack_from(f"<{n}Q", data, 16)
        (plen,) = struct.unpack_from("<Q", data, 16 + 8 * n)
        if len(data) != end + plen:
            raise CheckpointError(f"parity block has {len(data) - end} parity bytes, header says {plen}")
        parity = np.frombuffer(data, dtype=np.uint8, offset=end).copy()
        return cls(parity=parity, lengths=tuple(lengths))


def encode_group(chunks: Sequence[Chunk]) -> ParityBlock:
    """Whole-shard parity of a group: ``xor_encode`` plus the lengths."""
    arrays = [_u8(c) for c in chunks]
    return ParityBlock(parity=xor_encode(arrays), lengths=tuple(len(a) for a in arrays))


def _check_survivors(
    lengths: Sequence[int], survivors: Mapping[int, Chunk], missing: int
) -> dict[int, np.ndarray]:
    n = len(lengths)
    if not 0 <= missing < n:
        raise CheckpointError(f"missing member {missing} is not in 0..{n - 1}")
    lost = sorted(set(range(n)) - set(survivors) - {missing})
    if lost:
        raise CheckpointError(
            f"cannot rebuild member {missing}: members {lost} of the group are lost too;"
            " XOR rebuilds one per group"
        )
    extra = sorted(set(survivors) - set(range(n)) | ({missing} & set(survivors)))
    if extra:
        raise CheckpointError(f"survivors {extra} are not other members of a group of {n}")
    arrays = {m: _u8(c) for m, c in survivors.items()}
    for m, a in arrays.items():
        if len(a) != lengths[m]:
            raise CheckpointError(f"survivor {m} has {len(a)} bytes, parity recorded {lengths[m]}")
    return arrays


def strip_padding(buf: np.ndarray, length: int) -> bytes:
    """``buf[:length]`` as bytes; the rest must be the zero padding.

    Raises:
        CheckpointError: a padding byte is not zero (the parity does not match).
    """
    if buf[length:].any():
        raise CheckpointError("parity does not match the surviving shards (padding not zero)")
    return buf[:length].tobytes()


def rebuild(block: ParityBlock, survivors: Mapping[int, Chunk], missing: int) -> bytes:
    """The exact bytes of member ``missing`` from a whole-shard parity and all other members.

    Raises:
        CheckpointError: another member is missing too, a survivor has the wrong
            length, or the parity does not match.
    """
    arrays = _check_survivors(block.lengths, survivors, missing)
    longest = max(block.lengths, default=0)
    if len(block.parity) != longest:
        raise CheckpointError(f"parity has {len(block.parity)} bytes, expected {longest}")
    acc = np.zeros(_round8(longest), dtype=np.uint8)
    acc[:longest] = block.parity
    for a in arrays.values():
        xor_into(acc, a)
    return strip_padding(acc, block.lengths[missing])


def segment_size(lengths: Sequence[int]) -> int:
    """S: the segment (and parity row) size of a group with these shard lengths (>= 2 members)."""
    return _round8(-(-max(lengths, default=0) // (len(lengths) - 1)))


def member_rows(chunk: Chunk, member: int, lengths: Sequence[int]) -> np.ndarray:
    """Member ``member``'s contribution to the parity rows: an (n, S) uint8 matrix.

    Its segments sit in their rows (:func:`segment_row`), zeros elsewhere (row
    ``member`` is all zero). The XOR over all members of these matrices is the
    parity matrix, so a collective bitwise-XOR reduce-scatter (row r to member r)
    encodes a group without gathering shards; ``lengths`` comes from an allgather.

    Raises:
        CheckpointError: fewer than 2 members, member out of range, or the chunk
            length differs from ``lengths[member]``.
    """
    n = len(lengths)
    if n < 2:
        raise CheckpointError(f"an XOR group needs at least 2 members, got {n}")
    if not 0 <= member < n:
        raise CheckpointError(f"member {member} is not in 0..{n - 1}")
    a = _u8(chunk)
    if len(a) != lengths[member]:
        raise CheckpointError(f"member {member} has {len(a)} bytes, lengths say {lengths[member]}")
    s = segment_size(lengths)
    rows = np.zeros((n, s), dtype=np.uint8)
    for j in range(n - 1):
        seg = a[j * s : (j + 1) * s]
        rows[segment_row(member, j, n), : len(seg)] = seg
    return rows


def encode_group_distributed(chunks: Sequence[Chunk]) -> list[ParityBlock]:
    """The RAID-5 parity rows of a group (module docstring); item r is stored by member r.

    Raises:
        CheckpointError: fewer than 2 members.
    """
    arrays = [_u8(c) for c in chunks]
    n = len(arrays)
    if n < 2:
        raise CheckpointError(f"an XOR group needs at least 2 members, got {n}")
    lengths = tuple(len(a) for a in arrays)
    s = segment_size(lengths)
    rows = [np.zeros(s, dtype=np.uint8) for _ in range(n)]
    for m, a in enumerate(arrays):
        for j in range(n - 1):
            seg = a[j * s : (j + 1) * s]
            if len(seg):
                xor_into(rows[segment_row(m, j, n)], seg)
    return [ParityBlock(parity=rows[r], lengths=lengths) for r in range(n)]


def rebuild_distributed(
    parities: Mapping[int, ParityBlock], survivors: Mapping[int, Chunk], missing: int
) -> bytes:
    """The exact bytes of member ``missing`` from the other members' shards and parity rows.

    ``parities[r]`` is row r (held by member r); row ``missing`` is not needed.

    Raises:
        CheckpointError: another member (shard or parity row) is missing too,
            lengths disagree, or the parity does not match.
    """
    others = [r for r in parities if r != missing]
    if not others:
        raise CheckpointError(f"cannot rebuild member {missing}: no parity row survives")
    lengths = parities[others[0]].lengths
    n = len(lengths)
    arrays = _check_survivors(lengths, survivors, missing)
    need = sorted(set(range(n)) - {missing} - set(parities))
    if need:
        raise CheckpointError(f"cannot rebuild member {missing}: parity rows {need} are lost too")
    s = segment_size(lengths)
    for r in others:
        if parities[r].lengths != lengths or len(parities[r].parity) != s:
            raise CheckpointError(f"parity row {r} does not belong to the same group encoding")
    out = np.zeros((n - 1) * s, dtype=np.uint8)
    for j in range(n - 1):
        r = segment_row(missing, j, n)
        acc = out[j * s : (j + 1) * s]
        acc[:] = parities[r].parity
        for m, a in arrays.items():
            if m != r:
                jm = (r - m - 1) % n
                seg = a[jm * s : (jm + 1) * s]
                if len(seg):
                    xor_into(acc, seg)
    return strip_padding(out, lengths[missing])
