"""XOR parity arithmetic over byte strings: the whole-shard and the distributed (RAID-5) encodings.

Placement (which member's segment lands in which parity row) is ``redundancy``'s;
this module only computes. :func:`encode_group_distributed` /
:func:`rebuild_distributed` are the RAID-5 rows the XOR tier stores (one row of
S ~ longest / (n-1) bytes per member); :func:`member_rows` is one member's share of
that encoding as a matrix, for a collective bitwise-XOR reduce-scatter.
:func:`encode_group` / :func:`rebuild` are the same XOR over whole shards, for a
parity kept off the group (one block ~ the longest shard).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import numpy as np

from slurm_resilience.errors import CheckpointError

from .redundancy import segment_row

__all__ = [
    "xor_into",
    "xor_encode",
    "ParityBlock",
    "encode_group",
    "rebuild",
    "segment_size",
    "member_rows",
    "encode_group_distributed",
    "rebuild_distributed",
    "strip_padding",
]

Chunk = Union[bytes, bytearray, memoryview, np.ndarray]


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
