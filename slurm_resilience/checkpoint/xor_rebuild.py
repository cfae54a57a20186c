"""Rebuild an XOR-protected L1 shard lost with its node, into the rank that now holds the slot.

Collective over the checkpoint transfer group, at restore time (SCR's
``scr_rebuild_xor``)::

    scan     each rank: which committed steps it holds intact (shard verified,
             parity row readable, same group as now)          → held_steps
    gather   one all-reduce: every rank's list                 → gather_rows
    decide   pure: the newest step every group can complete
             (at most one member lacking per group)            → plan_rebuild
    move     survivors send the lost member n pieces per column round (their
             segments and parity rows, ``rebuild_sources``); it XORs them into
             the shard's segments and its own parity row       → execute
    store    the rebuilt shard is checked (every dataset CRC, the combined CRC
             the survivors recorded), then written with its parity row
    commit   one all-reduce of (ok, size, checksum); the owner of each root
             holding a rebuilt rank (``layout.root_owners``: one process per
             node-local directory) merges them into the step's manifest, then
             ``latest``; one all-gather of the owners' outcome

Every rank reaches the same plan from the same gathered data, so the collectives
match; a rank that cannot read its data still takes part (sending zeros) and
the rebuilt shard then fails its checksum instead of hanging anyone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..errors import CheckpointError
from ..files import write_private
from . import layout
from . import manifest as mf
from .hdf5_format import shard_crc32, verify_shard
from .redundancy import rebuild_sources, xor_groups
from .shard_io import crc32
from .xor_math import xor_into
from .xor_tier import ROUND_BYTES, ParityHeader, gather_rows, group_of, pread_into, read_parity, rounds, write_parity

__all__ = ["RebuildPlan", "plan_rebuild", "held_steps", "rebuild_tier"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RebuildPlan:
    """Pure result of :func:`plan_rebuild`.

    Fields:
        step: the step to rebuild, or None when no step can be completed.
        lost: lost rank -> its group (ascending global ranks); empty: nothing to do.
        why: one line for logs and events.
    """

    step: int | None
    lost: Mapping[int, tuple[int, ...]]
    why: str


def plan_rebuild(groups: Sequence[Sequence[int]], held: Sequence[Sequence[int]]) -> RebuildPlan:
    """Pure: the newest step every XOR group can complete, and who lacks it.

    ``held[r]`` lists the steps rank r holds intact (-1 entries are padding). A step
    is complete when each group lacks it on at most one member; newer steps some
    group lacks twice are skipped (they need PARTNER or L2).
    """
    steps = sorted({s for row in held for s in row if s >= 0}, reverse=True)
    for step in steps:
        lacking = [(tuple(g), [r for r in g if step not in held[r]]) for g in groups]
        if all(len(miss) <= 1 for _, miss in lacking):
            lost = {miss[0]: g for g, miss in lacking if miss}
            why = f"step {step}: rebuild ranks {sorted(lost)}" if lost else f"step {step}: nothing lost"
            return RebuildPlan(step=step, lost=lost, why=why)
    return RebuildPlan(step=None, lost={}, why="no step can be completed from XOR parity"
                       + (f" (newest {steps[0]} lacks two members of a group)" if steps else ""))


def held_steps(root: str, *, rank: int, group: Sequence[int], world_size: int, limit: int,
               verify: Callable[[str], list[str]], ownership: Any = None) -> list[int]:
    """The newest ``limit`` committed steps under ``root`` (of this run, when
    ``ownership`` is given) whose shard and parity row of ``rank`` are intact and were
    written for this ``group`` and world size."""
    out = []
    foreign = set(ownership.foreign_steps(root)) if ownership is not None else set()
    for step in [s for s in reversed(mf.complete_steps(root)) if s not in foreign][:limit]:
        try:
            rec = mf.read_manifest(root, step).shards.get(rank)
            hdr, _, _ = read_parity(layout.parity_path(root, step, rank))
        except CheckpointError:
            continue
        path = layout.shard_path(root, step, rank)
        if (rec is not None and hdr.step == step and hdr.world_size == world_size
                and list(hdr.group) == list(group) and hdr.group[hdr.member] == rank
                and hdr.lengths[hdr.member] == rec.nbytes and hdr.shard_crc32[hdr.member] == rec.crc32
                and not verify(path)):
            out.append(step)
    return out


def rebuild_tier(g: Any, *, root: str, tier: str, rank: int, nodes: Sequence[str], group_size: int,
                 limit: int, verify: Callable[[str], list[str]], owners: Sequence[int] | None = None,
                 round_bytes: int = ROUND_BYTES, ownership: Any = None) -> tuple[RebuildPlan, list[tuple[int, bool]]]:
    """Collective (transfer group): scan, agree and rebuild one XOR tier.

    Every rank of the group must call it with the same ``nodes``, ``group_size``,
    ``limit`` and ``owners`` (``owners[r]``: the rank that owns rank r's root,
    ``layout.root_owners``; default: every rank its own); a missing rank makes a
    collective raise ``StepAborted`` on the others. Returns the plan and
    [(lost rank, rebuilt, verified and committed)], identical on every rank.

    Raises:
        CheckpointError: no XOR grouping exists for ``nodes`` (same on every rank,
            before any collective).
        StepAborted: a collective failed or a new generation was published.
    """
    groups = xor_groups(nodes, group_size)
    group = group_of(rank, groups)
    mine = held_steps(root, rank=rank, group=group, world_size=len(nodes), limit=limit, verify=verify,
                      ownership=ownership)
    table = gather_rows(g, (mine + [-1] * limit)[:limit])
    plan = plan_rebuild(groups, table)
    if plan.step is None or not plan.lost:
        return plan, []
    owners = list(range(len(nodes))) if owners is None else list(owners)
    error, record = _execute(g, plan, root=root, rank=rank, round_bytes=round_bytes)
    rows = gather_rows(g, [0 if error else 1, *(record or (0, 0))])
    committed = 1
    mine = {r: rows[r] for r in plan.lost if owners[r] == rank and rows[r][0]}
    if mine:
        try:
            _commit_rebuilt(root, tier, plan.step, g.world_size, mine, groups,
                            stamp=ownership.stamp() if ownership is not None else {})
        except CheckpointError as e:
            committed = 0
            log.warning("cannot commit rebuilt ranks %s: %s", sorted(mine), e)
    done = g.all_gather_ints(committed)
    return plan, [(r, bool(rows[r][0] and done[owners[r]])) for r in sorted(plan.lost)]


def _commit_rebuilt(root: str, tier: str, step: int, world_size: int,
                    rebuilt: Mapping[int, Sequence[int]], groups: Sequence[Sequence[int]],
                    stamp: Mapping[str, str] | None = None) -> None:
    """The root's owner: add the ``rebuilt`` ranks (rank -> (ok, size, crc)) to the step's
    manifest, keeping the records of the root's other ranks, then ``latest``.

    Raises:
        CheckpointError: a shard is missing or the wrong size, or a file cannot be written.
    """
    try:
        old = mf.read_manifest(root, step)
    except CheckpointError:  # none yet (a replacement node's fresh disk) or unreadable: start over
        old = None
    stamp = stamp or {}  # the run's (ownership.stamp): another run's records at this step are not kept
    keep = old is not None and old.world_size == world_size and old.run_id == stamp.get("run_id", old.run_id)
    shards = dict(old.shards) if keep else {}
    extra = dict(old.extra) if keep else {}
    xor = dict(extra.get("xor", {}))
    for r, (_, length, crc) in rebuilt.items():
        shards[r] = mf.ShardRecord(layout.shard_name(r), length, crc)
        xor[str(r)] = {"parity": layout.parity_name(r), "group": group_of(r, groups), "rebuilt": True}
    mf.write_manifest(root, mf.Manifest(step=step, world_size=world_size, tier=tier, shards=shards,
                                        extra={**extra, "xor": xor}, **stamp))
    latest = mf.read_latest(root)
    if latest is None or latest < step:
        mf.set_latest(root, step)


def _execute(g: Any, plan: RebuildPlan, *, root: str, rank: int,
             round_bytes: int) -> tuple[str, tuple[int, int] | None]:
    """Collective: move the pieces and, on a lost rank, store the verified shard and parity row.

    Returns ("" or why it failed, (size, combined crc32) of the shard this rank stored or None)."""
    step = plan.step
    target = next((lost for lost, grp in plan.lost.items() if rank in grp and rank != lost), None)
    hdr = offset = None
    if target is not None:
        try:
            hdr, offset, _ = read_parity(layout.parity_path(root, step, rank), data=False)
        except CheckpointError:
            target = None  # held_steps just read it; gone now: the lost shard fails its check
    head = hdr.to_bytes() if hdr else b""
    table = gather_rows(g, [len(head), hdr.segment if hdr else 0])
    total = max(rounds(row[1], round_bytes) for row in table)
    mine = plan.lost.get(rank, ())  # our group, when we are the rank being rebuilt
    senders = [r for r in mine if r != rank and table[r][0]]
    recv = _exchange(g, head, target, {r: table[r][0] for r in senders})
    lost = _Lost(mine, rank, recv) if mine else None
    error = lost.error if lost else ""
    fds = _open_sources(root, step, rank) if hdr else (-1, -1)
    try:
        for k in range(total):
            c0 = k * round_bytes
            send = _pieces(fds, hdr, offset, rank, target, c0, round_bytes) if hdr else b""
            got = _exchange(g, send, target if hdr else None,
                            {r: _width(table[r][1], c0, round_bytes) * len(mine) for r in senders})
            if lost:
                for piece in got.values():
                    lost.absorb(piece, c0)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    if lost and not error:
        error = lost.store(root, step)
    return error, (lost.record if lost and not error else None)


def _width(segment: int, c0: int, round_bytes: int) -> int:
    return max(0, min(round_bytes, segment - c0))


def _exchange(g: Any, send: bytes | np.ndarray, target: int | None, sizes: Mapping[int, int]) -> dict[int, np.ndarray]:
    """Collective: ``send`` to ``target`` (None: nothing); receive ``sizes[r]`` bytes from each r."""
    data = np.frombuffer(bytearray(send), dtype=np.uint8) if isinstance(send, bytes) else send
    if target is None:
        data = data[:0]
    in_splits = [len(data) if r == target else 0 for r in range(g.world_size)]
    out_splits = [sizes.get(r, 0) for r in range(g.world_size)]
    out = np.empty(sum(out_splits), dtype=np.uint8)
    g.all_to_all(torch.from_numpy(out), torch.from_numpy(np.ascontiguousarray(data)), out_splits, in_splits)
    got, pos = {}, 0
    for r, n in enumerate(out_splits):
        if n:
            got[r] = out[pos:pos + n]
            pos += n
    return got


def _open_sources(root: str, step: int, rank: int) -> tuple[int, int]:
    fds = []
    for path in (layout.shard_path(root, step, rank), layout.parity_path(root, step, rank)):
        try:
            fds.append(os.open(path, os.O_RDONLY))
        except OSError:
            fds.append(-1)
    return fds[0], fds[1]


def _pieces(fds: tuple[int, int], hdr: ParityHeader, offset: int, rank: int, target: int,
            c0: int, round_bytes: int) -> np.ndarray:
    """A survivor's n pieces of one column round (``rebuild_sources``), unreadable bytes as zeros."""
    n, seg = len(hdr.group), hdr.segment
    width = _width(seg, c0, round_bytes)
    out = np.zeros(n * width, dtype=np.uint8)
    shard_len = hdr.lengths[hdr.member]
    for i, src in enumerate(rebuild_sources(hdr.member, hdr.group.index(target), n)):
        buf = memoryview(out)[i * width:(i + 1) * width]
        try:
            if src is None:
                pread_into(fds[1], buf, offset + c0, offset + seg)
            else:
                pread_into(fds[0], buf, src * seg + c0, shard_len)
        except OSError:
            pass  # zeros: the rebuilt shard fails its checksum, reported there
    return out


class _Lost:
    """The lost rank's side: the survivors' headers, the XOR accumulators, the commit."""

    def __init__(self, group: Sequence[int], rank: int, headers: Mapping[int, np.ndarray]) -> None:
        self.error, self.hdr = "", None
        parsed = []
        for r, blob in headers.items():
            try:
                parsed.append(ParityHeader.parse(blob.tobytes())[0])
            except CheckpointError as e:
                self.error = f"survivor {r}: {e}"
        keys = {(h.step, h.world_size, h.group, h.lengths, h.shard_crc32) for h in parsed}
        if len(parsed) != len(group) - 1 or len(keys) != 1 or list(parsed[0].group) != list(group):
            self.error = self.error or f"survivors of group {list(group)} disagree or are missing"
            return
        first = parsed[0]
        self.member = first.group.index(rank)
        self.hdr = dataclasses.replace(first, member=self.member)
        n, seg = len(group), first.segment
        self.seg, self.n = seg, n
        self.acc = np.zeros((n - 1) * seg, dtype=np.uint8)
        self.row = np.zeros(seg, dtype=np.uint8)

    def absorb(self, piece: np.ndarray, c0: int) -> None:
        if self.hdr is None:
            return
        width = len(piece) // self.n
        for j in range(self.n - 1):
            xor_into(self.acc[j * self.seg + c0: j * self.seg + c0 + width], piece[j * width:(j + 1) * width])
        xor_into(self.row[c0:c0 + width], piece[(self.n - 1) * width:])

    @property
    def record(self) -> tuple[int, int]:
        """(size, combined crc32) of the lost shard, as the survivors recorded it."""
        return self.hdr.lengths[self.member], self.hdr.shard_crc32[self.member]

    def store(self, root: str, step: int) -> str:
        """Write the rebuilt shard (checked) and its parity row; "" or why not. The
        manifest is the root owner's (:func:`_commit_rebuilt`)."""
        length, crc = self.record
        if self.acc[length:].any():
            return "rebuilt shard does not match the parity (padding not zero)"
        path = layout.shard_path(root, step, self.hdr.group[self.member])
        try:
            write_private(path, memoryview(self.acc)[:length])
            problems = verify_shard(path) or ([] if _crc_ok(path, crc) else
                                              ["combined checksum differs from the survivors' record"])
            if problems:
                os.unlink(path)
                return f"rebuilt shard is invalid: {problems[0]}"
            hdr = dataclasses.replace(self.hdr, parity_crc32=crc32(self.row))
            rank = hdr.group[self.member]
            write_parity(layout.parity_path(root, step, rank), hdr, self.row)
        except (OSError, CheckpointError) as e:
            return f"cannot store the rebuilt shard: {e}"
        return ""


def _crc_ok(path: str, crc: int) -> bool:
    try:
        return shard_crc32(path) == crc
    except CheckpointError:
        return False
