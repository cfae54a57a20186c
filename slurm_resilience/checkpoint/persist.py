"""What the writer thread does for one checkpoint on one disk tier: write, protect, vote, commit.

    persist_local    L1: shard (atomic, checksummed) → PARTNER copy exchange or XOR
                     parity → vote → manifest → ``latest``
    persist_shared   L2: rank 0 creates the step directory (on Lustre: striped, once)
                     → barrier → shard (the L1 file's bytes when there) → vote →
                     rank 0: manifest with every rank's size and checksum, ``latest``,
                     retention → barrier

Both are collective on the job's transfer group: every rank calls them for the same
checkpoints in the same order (the engine's writer handles checkpoints in step
order), so the collectives match. A rank whose write failed still takes part and
votes failed; the checkpoint is then not committed anywhere (``CheckpointError``).
Paths come from ``layout``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

from ..errors import CheckpointError
from ..files import makedirs_private, write_private
from . import layout
from . import manifest as mf
from .hdf5_format import shard_crc32, write_shard
from .partner_tier import exchange_partner
from .tiers import Redundancy, TierSpec
from .xor_tier import encode_step

__all__ = ["Job", "Lazy", "gather", "persist_local", "persist_shared", "first_line"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    """One queued checkpoint: the step, its disk tiers and what the writer needs of the generation."""

    step: int
    tiers: list[str]
    buffers: Any  # the engine's buffer set holding the host copy
    transfer: "Lazy | None"
    rank: int
    world_size: int
    nodes: tuple[str, ...]


class Lazy:
    """Builds the transfer group on first use (in the writer thread), once."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory, self._group = factory, None

    def get(self) -> Any:
        if self._group is None:
            self._group = self._factory()
        return self._group


def gather(job: Job, value: int) -> list[int]:
    """Collective (transfer group): every rank's ``value``, in rank order; [value] alone."""
    if job.transfer is None or job.world_size == 1:
        return [value]
    return job.transfer.get().all_gather_ints(int(value))


def first_line(exc: BaseException) -> str:
    s = str(exc).strip()
    return (s.splitlines()[0] if s else type(exc).__name__)[:300]


def _check_votes(job: Job, spec: TierSpec, votes: list[int], err: str = "") -> None:
    if not all(votes):
        failed = [r for r, v in enumerate(votes) if not v]
        raise CheckpointError(f"step {job.step} not committed on {spec.name}: ranks {failed} failed"
                              + (f" (here: {err})" if err else ""))


def persist_local(spec: TierSpec, root: str, job: Job, state: Any,
                  attrs: dict[str, Any]) -> tuple[str, int]:
    """Collective: write, protect and commit this rank's L1 shard; (its path, its size).

    Raises:
        CheckpointError: some rank's shard or redundancy is not durable (nothing committed).
        StepAborted: a collective failed or a new generation was published.
    """
    path = layout.shard_path(root, job.step, job.rank)
    ok, info, err = 1, None, ""
    try:
        info = write_shard(path, state, attrs=attrs)
    except (OSError, CheckpointError) as exc:
        ok, err = 0, first_line(exc)
    copies: dict[int, mf.ShardRecord] = {}
    extra: dict[str, Any] = {}
    if spec.redundancy is Redundancy.PARTNER and job.world_size > 1:
        copies = exchange_partner(job.transfer.get(), layout.partner_root(root), step=job.step,
                                  rank=job.rank, nodes=job.nodes, path=path if ok else None)
    elif spec.redundancy is Redundancy.XOR and job.world_size > 1:
        size, why = encode_step(job.transfer.get(), root=root, step=job.step,
                                rank=job.rank, nodes=job.nodes, group_size=spec.group_size,
                                shard=(path, info.nbytes, info.crc32) if ok else None)
        ok, err = (0, err or why) if why else (ok, err)
        extra = {"xor": {"parity": layout.parity_name(job.rank), "nbytes": size}}
    _check_votes(job, spec, gather(job, ok), err)
    man = mf.Manifest(step=job.step, world_size=job.world_size, tier=spec.name,
                      shards={job.rank: mf.ShardRecord(layout.shard_name(job.rank), info.nbytes, info.crc32)},
                      created=time.time(), extra=extra)
    mf.write_manifest(root, man)
    if copies:  # the partner copies this node holds form a tier root of their own
        proot = layout.partner_root(root)
        mf.write_manifest(proot, mf.Manifest(step=job.step, world_size=job.world_size,
                                             tier=f"{spec.name}-partner", shards=copies,
                                             created=time.time(), extra={}))
        mf.prune(proot, keep_last=spec.keep)
    mf.set_latest(root, job.step)
    return path, info.nbytes


def persist_shared(spec: TierSpec, root: str, job: Job, state: Any, attrs: dict[str, Any],
                   local_path: str | None, *, stripe_new_dir: Callable[[TierSpec, str], None]) -> int:
    """Collective: write this rank's L2 shard; rank 0 commits the step. Returns its size.

    Rank 0 creates the step directory first and, when it is new, hands it to
    ``stripe_new_dir`` (Lustre striping; must not raise); a barrier keeps every
    rank from creating its shard before that, since a file takes its layout from
    the directory when it is created.

    Raises:
        CheckpointError: some rank's shard is not durable (nothing committed).
        StepAborted: a collective failed or a new generation was published.
    """
    path = layout.shard_path(root, job.step, job.rank)
    ok, nbytes, crc, err = 1, 0, 0, ""
    if job.rank == 0:
        sdir = layout.step_dir(root, job.step)
        try:
            if not os.path.isdir(sdir):
                makedirs_private(sdir)
                stripe_new_dir(spec, sdir)
        except OSError as exc:  # this rank's vote fails; the others still meet it below
            ok, err = 0, first_line(exc)
    gather(job, 1)  # nobody creates a file in the step directory before it is striped
    try:
        if ok and local_path and os.path.exists(local_path):
            makedirs_private(os.path.dirname(path))
            with open(local_path, "rb") as f:
                write_private(path, f.read())
            nbytes, crc = os.path.getsize(path), shard_crc32(path)
        elif ok:
            info = write_shard(path, state, attrs=attrs)
            nbytes, crc = info.nbytes, info.crc32
    except (OSError, CheckpointError) as exc:
        ok, err = 0, first_line(exc)
    if err:
        log.warning("L2 write of step %d failed: %s", job.step, err)
    _check_votes(job, spec, gather(job, ok), err)
    sizes = gather(job, nbytes)
    crcs = gather(job, crc)
    if job.rank == 0:
        shards = {r: mf.ShardRecord(layout.shard_name(r), sizes[r], crcs[r]) for r in range(job.world_size)}
        mf.write_manifest(root, mf.Manifest(step=job.step, world_size=job.world_size, tier=spec.name,
                                            shards=shards, created=time.time(), extra={}))
        mf.set_latest(root, job.step)
        mf.prune(root, keep_last=spec.keep, keep_every=spec.keep_every)
    gather(job, 1)  # nobody reports L2 durable before rank 0 committed
    return nbytes
