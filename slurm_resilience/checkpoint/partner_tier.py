"""PARTNER redundancy for a node-local tier: a full copy of each shard on another node.

After a rank's L1 shard is durable, every rank of the transfer group calls
:func:`exchange_partner` at the same checkpoint: its shard's bytes go to
:func:`~.redundancy.partner_of` (the next rank on another node), and the copies
it receives (:func:`~.redundancy.partner_sources`) land on its own disk::

    ROOT/partner/step-N/rank-00003.h5    rank 3's shard, held by its partner
    ROOT/partner/step-N/manifest.json    written by the engine after the vote

Sizes travel first (one all-gather), then the bytes in one all-to-all: both are
collectives whose waits are sliced, so a newer plan abandons them promptly (gloo
send/recv waits are not).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..files import write_private
from . import layout
from . import manifest as mf
from .hdf5_format import shard_crc32
from .redundancy import partner_of, partner_sources

__all__ = ["exchange_partner"]


def exchange_partner(g: Any, proot: str, *, step: int, rank: int, nodes: Sequence[str],
                     path: str | None) -> dict[int, mf.ShardRecord]:
    """Collective (transfer group): send our shard to our partner, keep our sources' shards.

    ``path`` is this rank's durable shard, or None when it failed (it then sends
    nothing; its vote fails the checkpoint). Returns the copies stored under
    ``proot`` by source rank. A missing rank makes the collectives raise
    ``StepAborted`` on the others.

    Raises:
        CheckpointError: every rank is on one node (no partner exists).
        OSError: a received copy cannot be written.
        StepAborted: a collective failed or a new generation was published.
    """
    world = len(nodes)
    dst, srcs = partner_of(rank, nodes), partner_sources(rank, nodes)
    data = b""
    if path:
        with open(path, "rb") as f:
            data = f.read()
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    sizes = g.all_gather_ints(payload.numel())
    in_splits = [payload.numel() if r == dst else 0 for r in range(world)]
    out_splits = [sizes[r] if r in srcs else 0 for r in range(world)]
    out = torch.empty(sum(out_splits), dtype=torch.uint8)
    g.all_to_all(out, payload, out_splits, in_splits)
    kept, offset = {}, 0
    for r in range(world):
        n = out_splits[r]
        if n:
            dest = layout.shard_path(proot, step, r)
            write_private(dest, memoryview(out[offset:offset + n].numpy()))
            kept[r] = mf.ShardRecord(layout.shard_name(r), n, shard_crc32(dest))
            offset += n
    return kept
