"""XOR parity for a node-local tier: the parity file and the collective encode.

After a rank's L1 shard is durable, every rank of the transfer group calls
:func:`encode_step` at the same checkpoint. Ranks form groups on distinct nodes
(:func:`~.redundancy.xor_groups`); inside a group of n members the shards are cut
into n-1 segments of S bytes and member r stores parity row r (layout in
``redundancy``)::

    ROOT/step-N/rank-00002.h5      the shard (hdf5_format)
    ROOT/step-N/xor-00002.bin      parity row of rank 2 + the group's lengths/checksums

Encoding is a manual reduce-scatter: each member sends every other member the
segment that belongs to that member's row (one all-to-all, in column rounds of
at most ``round_bytes`` so memory stays bounded) and XORs what it receives. Bytes
move only through the transfer group's collectives, never a shared filesystem.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import CheckpointError
from ..files import write_private
from .layout import parity_path
from .redundancy import segment_in_row, xor_groups
from .xor_math import segment_size, xor_into
from .shard_io import crc32

__all__ = ["ROUND_BYTES", "ParityHeader", "write_parity", "read_parity",
           "group_of", "gather_rows", "rounds", "pread_into", "encode_step"]

ROUND_BYTES = 32 << 20  # columns of parity exchanged per all-to-all round
_MAGIC = b"SRXORP1\0"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParityHeader:
    """What a parity file records besides its row: enough to rebuild any one member.

    Fields:
        step: checkpoint step.
        world_size: ranks when it was written (groups depend on it).
        group: the group's global ranks, ascending; member i is ``group[i]``.
        member: index in ``group`` of the rank that stores this row (= the row).
        lengths: shard file size of every member, in member order.
        shard_crc32: combined checksum (``ShardInfo.crc32``) of every member's shard.
        parity_crc32: CRC32 of the row itself.
    """

    step: int
    world_size: int
    group: tuple[int, ...]
    member: int
    lengths: tuple[int, ...]
    shard_crc32: tuple[int, ...]
    parity_crc32: int

    @property
    def segment(self) -> int:
        """S, the size of the row and of every segment."""
        return segment_size(self.lengths)

    def to_bytes(self) -> bytes:
        doc = json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()
        return _MAGIC + struct.pack("<I", len(doc)) + doc

    @classmethod
    def parse(cls, data: bytes) -> tuple["ParityHeader", int]:
        """The header at the start of ``data`` and the offset where the row begins.

        Raises:
            CheckpointError: not a parity file, or a malformed header.
        """
        if len(data) < 12 or data[:8] != _MAGIC:
            raise CheckpointError("not an XOR parity file (bad magic)")
        (n,) = struct.unpack_from("<I", data, 8)
        try:
            doc = json.loads(data[12:12 + n])
            hdr = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"malformed XOR parity header: {e}") from e
        if not (len(hdr.group) == len(hdr.lengths) == len(hdr.shard_crc32) >= 2 and 0 <= hdr.member < len(hdr.group)):
            raise CheckpointError("malformed XOR parity header: group, lengths and checksums disagree")
        return hdr, 12 + n


def write_parity(path: str, header: ParityHeader, parity: np.ndarray) -> int:
    """Write a parity file atomically (0600, fsync); return its size."""
    data = header.to_bytes() + parity.tobytes()
    write_private(path, data)
    return len(data)


def read_parity(path: str, *, data: bool = True) -> tuple[ParityHeader, int, np.ndarray | None]:
    """(header, offset of the row, the row or None) of a parity file; the row's CRC is checked.

    Raises:
        CheckpointError: missing, unreadable, malformed, truncated or a CRC mismatch.
    """
    try:
        with open(path, "rb") as f:
            blob = f.read() if data else f.read(1 << 16)
    except OSError as e:
        raise CheckpointError(f"cannot read parity file {path}: {e.strerror or e}") from e
    hdr, offset = ParityHeader.parse(blob)
    if not data:
        return hdr, offset, None
    row = np.frombuffer(blob, dtype=np.uint8, offset=offset)
    if len(row) != hdr.segment:
        raise CheckpointError(f"parity file {path} has {len(row)} parity bytes, expected {hdr.segment}")
    if crc32(row) != hdr.parity_crc32:
        raise CheckpointError(f"parity file {path}: checksum mismatch")
    return hdr, offset, row


def group_of(rank: int, groups: Sequence[Sequence[int]]) -> list[int]:
    """The XOR group (list of ranks) that holds ``rank``."""
    return next(list(g) for g in groups if rank in g)


def gather_rows(g: Any, values: Sequence[int]) -> list[list[int]]:
    """Collective: every rank's ``values`` (same length everywhere), in rank order (one all-reduce)."""
    buf = torch.zeros((g.world_size, len(values)), dtype=torch.int64)
    buf[g.rank] = torch.tensor(list(values), dtype=torch.int64)
    g.all_reduce_sum(buf)
    return buf.tolist()


def rounds(segment: int, round_bytes: int) -> int:
    """All-to-all rounds that move ``segment`` columns, ``round_bytes`` at a time."""
    return -(-segment // round_bytes)


def pread_into(fd: int, buf: memoryview, offset: int, limit: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; bytes at or past ``limit`` read as zeros.

    Raises:
        OSError: the read fails or the file is shorter than ``limit``.
    """
    n = max(0, min(len(buf), limit - offset))
    done = 0
    while done < n:
        got = os.preadv(fd, [buf[done:n]], offset + done)
        if got <= 0:
            raise OSError(f"short read at offset {offset + done}")
        done += got
    if n < len(buf):
        buf[n:] = bytes(len(buf) - n)


def encode_step(g: Any, *, root: str, step: int, rank: int, nodes: Sequence[str],
                group_size: int, shard: tuple[str, int, int] | None,
                round_bytes: int = ROUND_BYTES) -> tuple[int, str]:
    """Collective (transfer group): compute and store this rank's parity row for ``step`` under tier ``root``.

    ``shard`` is (path, size, combined crc32) of this rank's durable shard, or None
    when it failed. Every rank must call it at the same checkpoint; a missing rank
    makes the collectives (and so this checkpoint) fail with ``StepAborted``.
    Returns (parity file size, ""), or (0, why) when this rank's parity is not
    durable: then its vote must fail. When any rank has no shard, every rank skips
    the exchange and returns (0, "") (that rank's vote fails the checkpoint).

    Raises:
        CheckpointError: no XOR grouping exists for ``nodes`` (same on every rank).
        StepAborted: a collective failed or a new generation was published.
    """
    groups = xor_groups(nodes, group_size)
    path, size, crc = shard if shard else ("", -1, 0)
    table = gather_rows(g, [size, crc])
    if any(r[0] < 0 for r in table):
        return 0, ""
    group = group_of(rank, groups)
    n, me = len(group), group.index(rank)
    lengths = tuple(table[r][0] for r in group)
    seg = segment_size(lengths)
    total = max(rounds(segment_size([table[r][0] for r in grp]), round_bytes) for grp in groups)
    parity = np.zeros(seg, dtype=np.uint8)
    peers = [r for r in group if r != rank]
    error = ""
    fd = _open(path)
    try:
        for k in range(total):
            c0 = k * round_bytes
            width = max(0, min(round_bytes, seg - c0))
            send = np.zeros(width * len(peers), dtype=np.uint8)
            for i, peer in enumerate(peers):
                j = segment_in_row(me, group.index(peer), n)
                try:
                    pread_into(fd, memoryview(send)[i * width:(i + 1) * width], j * seg + c0, size)
                except OSError as e:  # keep the collective going; our vote fails
                    error = error or f"cannot read shard {path}: {e}"
            splits = [width if r in peers else 0 for r in range(g.world_size)]
            recv = np.empty(width * len(peers), dtype=np.uint8)
            g.all_to_all(torch.from_numpy(recv), torch.from_numpy(send), splits, splits)
            for i in range(len(peers)):
                xor_into(parity[c0:c0 + width], recv[i * width:(i + 1) * width])
    finally:
        if fd >= 0:
            os.close(fd)
    if error:
        return 0, error
    header = ParityHeader(step=step, world_size=g.world_size, group=tuple(group), member=me, lengths=lengths,
                          shard_crc32=tuple(table[r][1] for r in group), parity_crc32=crc32(parity))
    try:
        return write_parity(parity_path(root, step, rank), header, parity), ""
    except OSError as e:
        return 0, f"cannot write XOR parity: {e.strerror or e}"


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY) if path else -1
    except OSError:
        return -1
