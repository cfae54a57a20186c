"""Deduplicated shared-tier (L2) checkpoints: each replicated tensor written once per step.

Every rank of a data-parallel job holds the same model and optimizer, so an L2
step made of full shards holds N identical copies. Instead, on the shared tier:

    every rank:  digest (CRC32 + Adler-32) of each tensor of its host copy
    agree:       one all-gather of the digests → the same plan on every rank (pure)
                 replicated = same key, dtype, shape and digest on every rank, and not a
                 sharded slice (``objects/<name>/shards/…`` of ``register_sharded``)
    plan_owners: each replicated tensor → one rank, balanced by bytes (largest first)
    write:       rank r's shard = the full skeleton + the replicated tensors it owns +
                 everything that is not replicated (its sharded slices, per-rank RNG …)
    manifest:    extra["dedup"] = {"owners": {dataset: rank}}; each file has attr dedup=1

A reader of rank r's state reads its own file and each owned tensor from its
owner's file (``shared_read``). Tensors are compared by content, not assumed equal
by name: a tensor that differs on any rank stays in every rank's file, so a restore
gives each rank exactly the bytes it saved. Ranks whose key sets differ → full
shards (no dedup) for that step. Node-local tiers (L1, partner, XOR) keep full
shards: they restore a node's own ranks fast, from their own disk.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Mapping, Sequence

import torch

from .hdf5_format import shard_contents
from .shard_io import crc32
from .state_tree import _component

__all__ = ["DEDUP", "plan_owners", "replicated", "sharded_prefixes", "digest", "signature", "agree",
           "owners_of", "coverage_problems"]

DEDUP = "dedup"  # key of the manifest's extra and the file attribute


def plan_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Pure: each key → one rank in ``0..world-1``, balanced by bytes; deterministic.

    Largest first (ties by key), each to the least loaded rank (ties: lowest rank).

    Raises:
        ValueError: ``world`` < 1 or a negative size.
    """
    if world < 1 or any(n < 0 for n in sizes.values()):
        raise ValueError(f"plan_owners: world={world}, sizes must be >= 0")
    loads, out = [0] * world, {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (loads[i], i))
        out[key] = r
        loads[r] += sizes[key]
    return out


def sharded_prefixes(state: Any) -> tuple[str, ...]:
    """Dataset-name prefixes of the sharded slices of ``state`` (a Session training state)."""
    totals = state.get("shard_totals") if isinstance(state, dict) else None
    return tuple(f"objects/objects/{_component(n)}/shards/" for n in (totals or {}))


def replicated(keys: Sequence[str], rows: Sequence[Sequence[int]], sharded: tuple[str, ...]) -> list[str]:
    """Pure: the keys (``rows[rank][i]`` is rank's digest of ``keys[i]``) equal on every rank
    and not sharded slices."""
    return [k for i, k in enumerate(keys)
            if not k.startswith(sharded) and all(row[i] == rows[0][i] for row in rows)]


def digest(t: torch.Tensor, rank: int) -> int:
    """A 63-bit content digest; a tensor that cannot be viewed as bytes gets ``-1 - rank``
    (differs on every rank: never deduplicated)."""
    try:
        buf = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    except Exception:  # noqa: BLE001 - whatever it is, this rank keeps its own copy
        return -1 - rank
    meta = f"{t.dtype}:{tuple(t.shape)}".encode()  # same bytes, other dtype or shape: not equal
    return ((crc32(buf, crc32(meta)) & 0xFFFFFFFF) << 31) ^ zlib.adler32(buf, zlib.adler32(meta))


def signature(tensors: Mapping[str, torch.Tensor]) -> int:
    """CRC32 of the sorted keys: equal on ranks whose digest rows line up."""
    return crc32("\n".join(sorted(tensors)).encode())


def agree(tensors: Mapping[str, torch.Tensor], state: Any, *, rank: int, world: int,
          gather: Callable[[list[int]], list[list[int]]]) -> dict[str, int]:
    """Collective (``gather``: every rank's row, in rank order): the owner map of this step,
    the same on every rank; {} when nothing can be deduplicated (world 1, layouts differ)."""
    keys = sorted(tensors)
    if world < 2 or not keys:
        return {}
    head = gather([len(keys), signature(tensors)])
    if any(row != head[0] for row in head):
        return {}
    rows = gather([digest(tensors[k], rank) for k in keys])
    same = replicated(keys, rows, sharded_prefixes(state))
    return plan_owners({k: tensors[k].numel() * tensors[k].element_size() for k in same}, world)


def owners_of(extra: Mapping[str, Any]) -> dict[str, int]:
    """The owner map a manifest's ``extra`` records ({} for a step of full shards).

    Raises:
        ValueError: the record is malformed.
    """
    rec = extra.get(DEDUP)
    if rec is None:
        return {}
    owners = rec.get("owners") if isinstance(rec, dict) else None
    if not isinstance(owners, dict) or not all(isinstance(k, str) and type(v) is int for k, v in owners.items()):
        raise ValueError(f"malformed {DEDUP!r} record in the manifest")
    return owners


def coverage_problems(path: str, owners: Mapping[str, int], files: Mapping[int, str]) -> list[str]:
    """Every dataset the skeleton of ``path`` names that is neither in that file nor in its
    owner's file (``files``: rank → path). Reads metadata only.

    Raises:
        CheckpointError: a file is missing or corrupt.
    """
    names, want = shard_contents(path)
    held: dict[int, set[str]] = {}
    problems = []
    for key in want:
        if key in names:
            continue
        owner = owners.get(key)
        if owner is None or owner not in files:
            problems.append(f"dedup step: {path} names dataset {key}, held by no file")
            continue
        if owner not in held:
            held[owner] = shard_contents(files[owner])[0]
        if key not in held[owner]:
            problems.append(f"dedup step: dataset {key} missing from its owner's file {files[owner]}")
    return problems
