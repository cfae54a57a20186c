"""PARTNER redundancy for a node-local tier: a full copy of each shard on another node.

After a rank's L1 shard is durable, every rank of the transfer group calls
:func:`exchange_partner` at the same checkpoint: its shard's bytes go to
:func:`~.redundancy.partner_of` (same local index on the next node), and the
copies it receives (:func:`~.redundancy.partner_sources`) land on its node's disk::

    ROOT/partner/step-N/rank-00003.h5    rank 3's shard, held by its partner's node
    ROOT/partner/step-N/manifest.json    written after the vote by the root's owner

Sizes and checksums travel first (one all-reduce), then the bytes in one
all-to-all: both are collectives whose waits are sliced, so a newer plan abandons
them promptly (gloo send/recv waits are not). A copy that cannot be written or
whose checksum differs from the sender's makes the receiver's vote fail; it never
raises before the vote, which would leave the other ranks' collectives unmatched.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import CheckpointError
from ..files import write_private
from . import layout
from .hdf5_format import shard_crc32
from .redundancy import partner_map
from .xor_tier import gather_rows

__all__ = ["exchange_partner"]


def exchange_partner(g: Any, proot: str, *, step: int, rank: int, nodes: Sequence[str],
                     shard: tuple[str, int, int] | None) -> str:
    """Collective (transfer group): send our shard to our partner, keep our sources' shards.

    ``shard`` is (path, size, combined crc32) of this rank's durable shard, or None
    when it failed (it then sends nothing; its vote fails the checkpoint). The
    copies are stored under ``proot``; their manifest is written after the vote by
    the root's owner. Returns "" or why a received copy is not durable (then this
    rank's vote must fail). A missing rank makes the collectives raise
    ``StepAborted`` on the others.

    Raises:
        CheckpointError: every rank is on one node (no partner exists; same on every rank).
        StepAborted: a collective failed or a new generation was published.
    """
    holders = partner_map(nodes)
    dst, srcs = holders[rank], [r for r, p in enumerate(holders) if p == rank]
    path, _, crc = shard if shard else ("", 0, 0)
    error, data = "", b""
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            error = f"cannot read shard {path}: {e.strerror or e}"
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    table = gather_rows(g, [payload.numel(), crc if data else 0])
    in_splits = [payload.numel() if r == dst else 0 for r in range(len(nodes))]
    out_splits = [table[r][0] if r in srcs else 0 for r in range(len(nodes))]
    out = torch.empty(sum(out_splits), dtype=torch.uint8)
    g.all_to_all(out, payload, out_splits, in_splits)
    offset = 0
    for r in srcs:
        n = out_splits[r]
        if not n:  # the source failed: its own vote fails the checkpoint
            continue
        dest = layout.shard_path(proot, step, r)
        try:
            write_private(dest, memoryview(out[offset:offset + n].numpy()))
            if shard_crc32(dest) != table[r][1]:
                error = error or f"partner copy of rank {r} differs from its checksum"
        except (OSError, CheckpointError) as e:
            error = error or f"cannot store the partner copy of rank {r}: {e}"
        offset += n
    return error
