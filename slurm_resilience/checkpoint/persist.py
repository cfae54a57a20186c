"""What the writer thread does for one checkpoint on one disk tier: write, protect, vote, commit.

    persist_local    L1: shard (atomic, checksummed) → PARTNER copy exchange or XOR
                     parity → vote (every rank's size and checksum) → the root's
                     owner: manifest listing the root's ranks, ``latest`` → barrier
    prune_local      L1, after the commit: the root's owner alone applies retention
    persist_shared   L2: rank 0 creates the step directory (on Lustre: striped, once)
                     → barrier → owner plan (dedup: each replicated tensor once per
                     step) → shard: skeleton + owned + non-replicated tensors (full
                     shard, the L1 file's bytes, when nothing dedups) → vote →
                     rank 0: manifest with every rank's size and checksum, ``latest``,
                     retention → barrier

Both are collective on the job's transfer group: every rank calls them for the same
checkpoints in the same order (the engine's writer handles checkpoints in step
order), so the collectives match. A rank whose write failed still takes part and
votes failed; the checkpoint is then not committed anywhere (``CheckpointError``).

Several ranks may share one node-local root (the G ranks of a node): each writes
only its own files (shard, parity row, the partner copies it receives); the
root's owner (``layout.root_owners``, its lowest rank) writes the shared files —
manifests and ``latest`` — and deletes old steps, so no two processes ever write
or delete the same path. Paths come from ``layout``.
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
from .dedup import DEDUP, agree
from .hdf5_format import shard_crc32, write_flat, write_shard
from .partner_tier import exchange_partner
from .redundancy import partner_map
from .tiers import Redundancy, TierSpec
from .xor_tier import encode_step, gather_rows

__all__ = ["Job", "Lazy", "gather", "persist_local", "prune_local", "persist_shared", "first_line"]

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
    owners: dict[str, tuple[int, ...]]  # node-local tier -> the owner of every rank's root
    ownership: Any  # the run's ``ownership.Ownership``: manifests name the run; others' steps stay


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


def gather_table(job: Job, row: list[int]) -> list[list[int]]:
    """Collective (transfer group): every rank's ``row`` (same length), in rank order; [row] alone."""
    if job.transfer is None or job.world_size == 1:
        return [list(row)]
    return gather_rows(job.transfer.get(), row)


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type when empty), at most 300 characters."""
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
        CheckpointError: some rank's shard or redundancy is not durable, or some
            root's owner could not commit it (nothing committed on that root).
        StepAborted: a collective failed or a new generation was published.
    """
    path = layout.shard_path(root, job.step, job.rank)
    ok, nbytes, crc, parity, err = 1, 0, 0, 0, ""
    try:
        info = write_shard(path, state, attrs=attrs)
        nbytes, crc = info.nbytes, info.crc32
    except (OSError, CheckpointError) as exc:
        ok, err = 0, first_line(exc)
    why = ""
    if spec.redundancy is Redundancy.PARTNER and job.world_size > 1:
        why = exchange_partner(job.transfer.get(), layout.partner_root(root), step=job.step, rank=job.rank,
                               nodes=job.nodes, shard=(path, nbytes, crc) if ok else None)
    elif spec.redundancy is Redundancy.XOR and job.world_size > 1:
        parity, why = encode_step(job.transfer.get(), root=root, step=job.step,
                                  rank=job.rank, nodes=job.nodes, group_size=spec.group_size,
                                  shard=(path, nbytes, crc) if ok else None)
    if why:
        ok, err = 0, err or why
    table = gather_table(job, [ok, nbytes, crc, parity])  # the vote, with what the owners commit
    _check_votes(job, spec, [row[0] for row in table], err)
    owners = job.owners[spec.name]
    committed = 1
    if owners[job.rank] == job.rank:
        try:
            _commit_root(spec, root, job, [r for r, o in enumerate(owners) if o == job.rank], table)
        except CheckpointError as exc:
            committed, err = 0, first_line(exc)
    done = gather(job, committed)  # nobody reports L1 durable before its root's owner committed
    if not all(done):
        raise CheckpointError(f"step {job.step} not committed on {spec.name}: the owners of the roots of ranks "
                              f"{[r for r, o in enumerate(owners) if not done[o]]} failed"
                              + (f" (here: {err})" if err else ""))
    return path, nbytes


def _commit_root(spec: TierSpec, root: str, job: Job, ranks: list[int], table: list[list[int]]) -> None:
    """The root's owner, after the vote: the manifests of ``ranks`` (the ranks sharing
    ``root``) and of the partner copies they hold, then ``latest``.

    Raises:
        CheckpointError: a shard is missing or the wrong size, or a file cannot be written.
    """
    def record(r: int) -> mf.ShardRecord:
        return mf.ShardRecord(layout.shard_name(r), table[r][1], table[r][2])

    extra: dict[str, Any] = {}
    if spec.redundancy is Redundancy.XOR and job.world_size > 1:
        extra = {"xor": {str(r): {"parity": layout.parity_name(r), "nbytes": table[r][3]} for r in ranks}}
    mf.write_manifest(root, mf.Manifest(step=job.step, world_size=job.world_size, tier=spec.name,
                                        shards={r: record(r) for r in ranks}, created=time.time(), extra=extra,
                                        **job.ownership.stamp()))
    if spec.redundancy is Redundancy.PARTNER and job.world_size > 1:
        held = {src for src, holder in enumerate(partner_map(job.nodes)) if holder in ranks}
        if held:  # the partner copies this root holds form a tier root of their own
            mf.write_manifest(layout.partner_root(root), mf.Manifest(
                step=job.step, world_size=job.world_size, tier=f"{spec.name}-partner",
                shards={r: record(r) for r in held}, created=time.time(), extra={}, **job.ownership.stamp()))
    mf.set_latest(root, job.step)


def prune_local(spec: TierSpec, root: str, job: Job) -> list[int]:
    """Retention of a node-local root after a commit, by the root's owner only (others: []).

    One process per root deletes, so node-mates never race on a directory; a step
    already gone is not an error (``manifest.prune``). Returns the steps deleted.

    Raises:
        CheckpointError: a step directory cannot be removed.
    """
    if job.owners[spec.name][job.rank] != job.rank:
        return []
    deleted = mf.prune(root, keep_last=spec.keep, foreign=job.ownership.foreign_steps(root))
    proot = layout.partner_root(root)
    mf.prune(proot, keep_last=spec.keep, foreign=job.ownership.foreign_steps(proot))
    return deleted


def persist_shared(spec: TierSpec, root: str, job: Job, state: Any, attrs: dict[str, Any],
                   local_path: str | None, *, stripe_new_dir: Callable[[TierSpec, str], None],
                   dedup: bool = True) -> int:
    """Collective: write this rank's L2 shard; rank 0 commits the step. Returns its size.

    With ``dedup`` (world > 1) the ranks agree on an owner per replicated tensor
    (``dedup.agree``) and each writes only what it owns plus its non-replicated
    tensors; the manifest records the owner map (``extra["dedup"]``). Otherwise each
    rank writes its full shard (the L1 file's bytes when there).

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
    owners = agree(job.buffers.tensors, state, rank=job.rank, world=job.world_size,
                   gather=lambda row: gather_table(job, row)) if dedup and job.transfer is not None else {}
    try:
        if ok and owners:  # this rank's part of a deduplicated step (dedup.py)
            mine = {k: t for k, t in job.buffers.tensors.items() if owners.get(k, job.rank) == job.rank}
            info = write_flat(path, mine, job.buffers.skeleton, attrs=dict(attrs, **{DEDUP: 1}))
            nbytes, crc = info.nbytes, info.crc32
        elif ok and local_path and os.path.exists(local_path):
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
                                            shards=shards, created=time.time(),
                                            extra={DEDUP: {"owners": owners}} if owners else {},
                                            **job.ownership.stamp()))
        mf.set_latest(root, job.step)
        mf.prune(root, keep_last=spec.keep, keep_every=spec.keep_every, foreign=job.ownership.foreign_steps(root))
    gather(job, 1)  # nobody reports L2 durable before rank 0 committed
    return nbytes
