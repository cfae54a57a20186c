"""The one reader of a rank's state from a committed checkpoint step (any tier).

Every reader of checkpoint files goes through it — the engine's restore
(``CheckpointEngine.best``/``load``), the resharded restore (``worker/reshard.py``)
and ``ckpt verify`` (``manifest.validate_step``) — so a deduplicated shared-tier
step (``dedup``) reads the same as a step of full shards::

    read_rank_state(path)     path = STEP_DIR/rank-R.h5 of a committed step
      full shards (no "dedup" in the manifest's extra): read_shard(path)
      dedup: path's skeleton, its own datasets (sharded slices, per-rank tensors,
             the replicated tensors R owns) + each other replicated tensor from
             its owner's file; every dataset's CRC32 checked on the way
    verify_rank_problems(path)  the files that read needs: checksums + coverage
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError
from . import layout
from .dedup import coverage_problems, owners_of
from .hdf5_format import read_datasets, read_shard, unflatten_state, verify_shard
from .manifest import Manifest
from .state_tree import refs

__all__ = ["step_owners", "read_rank_state", "verify_rank_problems"]


def step_owners(path: str) -> tuple[dict[str, int], dict[int, str]]:
    """(owner map, rank → file path) of the step holding ``path``; ({}, {}) for full shards
    or a file outside a committed step.

    Raises:
        CheckpointError: the step's manifest is unreadable or malformed.
    """
    sdir = os.path.dirname(os.path.abspath(path))
    mpath = os.path.join(sdir, layout.MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            man = Manifest.from_json(f.read())
    except FileNotFoundError:
        return {}, {}
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read manifest {mpath}: {e}") from e
    try:
        owners = owners_of(man.extra)
    except ValueError as e:
        raise CheckpointError(f"corrupt manifest {mpath}: {e}") from e
    return owners, ({r: os.path.join(sdir, rec.file) for r, rec in man.shards.items()} if owners else {})


def read_rank_state(path: str, *, verify: bool = True, into: Mapping[str, torch.Tensor] | None = None) -> Any:
    """The state saved in the shard ``path``, assembled from its step's files when deduplicated;
    tensors read straight into ``into``'s where they fit (``hdf5_format.read_shard``).

    Raises:
        CheckpointError: a file is missing or corrupt, a checksum fails, or an owner's
            file lacks a dataset.
    """
    owners, files = step_owners(path)
    if not owners:
        return read_shard(path, verify=verify, into=into)[0]
    tensors, skeleton, _ = read_datasets(path, verify=verify, into=into)
    by_owner: dict[int, list[str]] = {}
    for key in refs(skeleton):
        if key not in tensors:
            owner = owners.get(key)
            if owner not in files:
                raise CheckpointError(f"dedup step: {path} names dataset {key}, held by no file")
            by_owner.setdefault(owner, []).append(key)
    for owner, keys in sorted(by_owner.items()):
        tensors.update(read_datasets(files[owner], keys, verify=verify, into=into)[0])
    try:
        return unflatten_state(tensors, skeleton)
    except CheckpointError as e:
        raise CheckpointError(f"corrupt shard {path}: {e}") from e


def verify_rank_problems(path: str, verify_file: Callable[[str], list[str]] = verify_shard) -> list[str]:
    """Every problem a ``read_rank_state(path)`` would hit: each file it reads verified
    (``verify_file``, default ``verify_shard``) and, when deduplicated, every tensor held by
    some file. Never raises for a bad checkpoint."""
    try:
        owners, files = step_owners(path)
    except CheckpointError as e:
        return [str(e)]
    problems = list(verify_file(path))
    if problems:
        return problems
    for owner in sorted(set(owners.values())):
        if owner in files and files[owner] != path:
            problems += verify_file(files[owner])
    # also without owners: a dedup file (attr dedup=1) committed by a manifest without
    # the record (a headless commit of an interrupted dedup step) lacks tensors
    if not problems:
        try:
            problems = coverage_problems(path, owners, files)
        except CheckpointError as e:
            problems = [str(e)]
    return problems
