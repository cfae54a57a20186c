"""Step directories, manifests and the ``latest`` pointer of one tier's root.

The names of these files are ``layout``'s (re-exported here: ``step_dir``,
``shard_path``, ``shard_name``, ``manifest_path``)::

    ROOT/step-00000100/rank-00000.h5    one shard per rank (hdf5_format)
    ROOT/step-00000100/manifest.json    written last, once every shard is durable
    ROOT/latest                         "100\\n", moved only after the manifest

A step directory without ``manifest.json`` is incomplete: a write in progress or
one that died. Commit order is shards -> manifest -> latest, each atomic, so
``latest`` never names a step whose shards are not all durable. Deletion runs the
other way: a step's manifest is removed before its shards, so a crash mid-prune
leaves an incomplete directory, never a manifest without shards.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

from ..errors import CheckpointError, ConfigError
from ..files import fsync_dir, write_private
from .dedup import coverage_problems, owners_of
from .hdf5_format import shard_crc32, verify_shard
from .layout import latest_path, manifest_path, shard_name, shard_path, step_dir, step_dirs

__all__ = [
    "MANIFEST_FORMAT",
    "ShardRecord",
    "Manifest",
    "step_dir",
    "shard_path",
    "shard_name",
    "manifest_path",
    "write_manifest",
    "read_manifest",
    "set_latest",
    "read_latest",
    "complete_steps",
    "incomplete_steps",
    "validate_step",
    "steps_to_prune",
    "prune",
]

MANIFEST_FORMAT = "slurm_resilience/manifest/1"


@dataclass(frozen=True)
class ShardRecord:
    """One rank's shard as committed: path relative to the step dir, size, checksum."""

    file: str
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint step in one tier.

    ``shards`` holds one record per rank whose shard lives under this root: every
    rank ``0 .. world_size-1`` on a shared tier (L2), only the node's own ranks on
    a node-local one (L1). ``extra`` holds JSON-serializable facts for the engine
    (data position, generation ...). ``run_id`` and ``job_id`` name the run that wrote
    it (``run_identity.RunIdentity``); a manifest written before run ids has None, and
    a restore treats it as another run's (``checkpoint/ownership.py``).

    Raises:
        CheckpointError: on construction, when a field is out of range, a rank is
            missing, or a shard file is not a plain relative name.
    """

    step: int
    world_size: int
    tier: str
    shards: Mapping[int, ShardRecord]
    created: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    job_id: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.step) or self.step < 0:
            raise CheckpointError(f"manifest step must be an int >= 0, got {self.step!r}")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise CheckpointError(f"manifest world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.tier, str) or not self.tier:
            raise CheckpointError(f"manifest tier must be a non-empty str, got {self.tier!r}")
        if not self.shards or not all(_is_int(r) and 0 <= r < self.world_size for r in self.shards):
            raise CheckpointError(
                f"manifest of step {self.step} must list ranks in 0..{self.world_size - 1}, got {sorted(self.shards)}"
            )
        for rank, rec in self.shards.items():
            if not isinstance(rec, ShardRecord):
                raise CheckpointError(f"manifest shard of rank {rank} is not a ShardRecord")
            if not isinstance(rec.file, str) or rec.file in ("", ".", "..") or "/" in rec.file or "\\" in rec.file:
                raise CheckpointError(f"manifest shard of rank {rank} must be a plain file name, got {rec.file!r}")
            if not _is_int(rec.nbytes) or rec.nbytes < 0 or not _is_int(rec.crc32) or not 0 <= rec.crc32 < 2**32:
                raise CheckpointError(f"manifest shard of rank {rank} has invalid size or checksum")
        if isinstance(self.created, bool) or not isinstance(self.created, (int, float)) or not math.isfinite(self.created):
            raise CheckpointError(f"manifest created must be a finite number, got {self.created!r}")
        if any(v is not None and not isinstance(v, str) for v in (self.run_id, self.job_id)):
            raise CheckpointError(f"manifest run_id/job_id must be str, got {self.run_id!r}/{self.job_id!r}")
        object.__setattr__(self, "shards", dict(sorted(self.shards.items())))
        object.__setattr__(self, "extra", dict(self.extra))

    def to_json(self) -> str:
        """Serialize to JSON text.

        Raises:
            CheckpointError: ``extra`` is not JSON-serializable.
        """
        doc = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "tier": self.tier,
            "created": self.created,
            "shards": {str(r): {"file": s.file, "nbytes": s.nbytes, "crc32": s.crc32} for r, s in self.shards.items()},
            "extra": self.extra,
        }
        if self.run_id is not None:
            doc.update(run_id=self.run_id, job_id=self.job_id)
        try:
            return json.dumps(doc, indent=1, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"manifest of step {self.step}: extra is not JSON-serializable ({e})") from e

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse JSON text written by ``to_json``.

        Raises:
            CheckpointError: the text is not JSON, has the wrong format tag, or a
                field is missing or has the wrong type.
        """
        try:
            doc = json.loads(text)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"manifest is not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise CheckpointError(f"manifest lacks format {MANIFEST_FORMAT!r}")
        try:
            shards_doc = doc["shards"]
            if not isinstance(shards_doc, dict) or not isinstance(doc["extra"], dict):
                raise TypeError("shards and extra must be objects")
            shards = {}
            for rank, rec in shards_doc.items():
                if not (rank.isascii() and rank.isdigit()):
                    raise TypeError(f"rank {rank!r} is not a number")
                if not isinstance(rec, dict) or set(rec) != {"file", "nbytes", "crc32"}:
                    raise TypeError(f"bad shard record for rank {rank!r}")
                shards[int(rank)] = ShardRecord(**rec)
            return cls(
                step=doc["step"],
                world_size=doc["world_size"],
                tier=doc["tier"],
                shards=shards,
                created=doc["created"],
                extra=doc["extra"],
                run_id=doc.get("run_id"),
                job_id=doc.get("job_id"),
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"malformed manifest: {e!r}") from e


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- commit


def write_manifest(root: str, manifest: Manifest, *, require_shards: bool = True) -> str:
    """Commit a step: write its manifest atomically (mode 0600); return its path.

    Call it only once every rank's shard is durable. With ``require_shards`` (the
    default) it refuses when a listed shard is missing or has the wrong size;
    tiers whose shards live on other nodes (node-local L1) pass False.

    Raises:
        CheckpointError: a shard is missing or the wrong size, ``extra`` is not
            JSON-serializable, or the file cannot be written.
    """
    if require_shards:
        problems = _shard_problems(root, manifest)
        if problems:
            raise CheckpointError(f"refusing to commit step {manifest.step}: {problems[0]}")
    text = manifest.to_json()
    try:
        return write_private(manifest_path(root, manifest.step), text)
    except OSError as e:
        raise CheckpointError(f"cannot write manifest of step {manifest.step} under {root}: {e}") from e


def read_manifest(root: str, step: int) -> Manifest:
    """Read the manifest of ``step``.

    Raises:
        CheckpointError: it is missing, unreadable, malformed, or for another step.
    """
    path = manifest_path(root, step)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"missing manifest {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read manifest {path}: {e}") from e
    try:
        manifest = Manifest.from_json(text)
    except CheckpointError as e:
        raise CheckpointError(f"corrupt manifest {path}: {e}") from e
    if manifest.step != step:
        raise CheckpointError(f"corrupt manifest {path}: it records step {manifest.step}")
    return manifest


def set_latest(root: str, step: int) -> None:
    """Point ``ROOT/latest`` at ``step`` atomically; the step must be committed.

    Raises:
        CheckpointError: the step has no manifest, or the file cannot be written.
    """
    if not os.path.isfile(manifest_path(root, step)):
        raise CheckpointError(f"refusing to set latest to step {step}: it has no manifest under {root}")
    try:
        write_private(latest_path(root), f"{step}\n")
    except OSError as e:
        raise CheckpointError(f"cannot write {latest_path(root)}: {e}") from e


def read_latest(root: str) -> int | None:
    """The step ``ROOT/latest`` names, or None when there is no such file.

    Raises:
        CheckpointError: the file is unreadable or does not hold a step number.
    """
    path = latest_path(root)
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not text.isdigit():
        raise CheckpointError(f"corrupt {path}: {text[:40]!r} is not a step number")
    return int(text)


# --------------------------------------------------------------------------- scan


def complete_steps(root: str) -> list[int]:
    """Steps under ``root`` that have a manifest, ascending (a missing root: [])."""
    return sorted(s for s in step_dirs(root) if os.path.isfile(manifest_path(root, s)))


def incomplete_steps(root: str) -> list[int]:
    """Step directories under ``root`` without a manifest, ascending."""
    return sorted(s for s in step_dirs(root) if not os.path.isfile(manifest_path(root, s)))


def _shard_problems(root: str, manifest: Manifest) -> list[str]:
    problems = []
    for rank, rec in manifest.shards.items():
        path = os.path.join(step_dir(root, manifest.step), rec.file)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"shard of rank {rank} missing: {path}")
            continue
        if size != rec.nbytes:
            problems.append(f"shard of rank {rank} is {size} bytes, manifest says {rec.nbytes}: {path}")
    return problems


def validate_step(root: str, step: int, *, deep: bool = False) -> list[str]:
    """Every problem with committed ``step``; an empty list means it is restorable.

    Checks the manifest, that each shard exists with the recorded size and, with
    ``deep``, every dataset checksum and the combined checksum against the record
    (reads all the data) and, for a deduplicated step, that every tensor a rank's
    skeleton names is in its file or its owner's. Never raises for a bad checkpoint.
    """
    try:
        manifest = read_manifest(root, step)
    except CheckpointError as e:
        return [str(e)]
    problems = _shard_problems(root, manifest)
    if deep and not problems:
        for rank, rec in manifest.shards.items():
            path = os.path.join(step_dir(root, step), rec.file)
            shard = verify_shard(path)
            problems.extend(shard)
            if not shard and shard_crc32(path) != rec.crc32:
                problems.append(f"shard of rank {rank} checksum differs from the manifest: {path}")
        problems += _dedup_problems(root, manifest) if not problems else []
    return problems


def _dedup_problems(root: str, manifest: Manifest) -> list[str]:
    """Every rank's skeleton finds each tensor in its own file or (a deduplicated step,
    ``dedup``) its owner's; metadata only."""
    try:
        owners = owners_of(manifest.extra)
        files = {r: os.path.join(step_dir(root, manifest.step), rec.file) for r, rec in manifest.shards.items()}
        return [p for path in files.values() for p in coverage_problems(path, owners, files)]
    except (ValueError, CheckpointError) as e:
        return [f"step {manifest.step}: {e}"]


# --------------------------------------------------------------------------- retention


def steps_to_prune(
    complete: Sequence[int],
    incomplete: Sequence[int],
    latest: int | None,
    keep_last: int,
    keep_every: int | None = None,
    protect: Collection[int] = (),
) -> list[int]:
    """Pure: which steps to delete, ascending.

    Complete steps are kept when they are among the newest ``keep_last``, a
    multiple of ``keep_every``, ``latest``, or in ``protect``; the rest go.
    Incomplete steps older than the newest complete step are dead writes and go;
    newer ones may still be in progress and stay. ``latest`` and ``protect`` are
    never deleted, whatever their state.

    Raises:
        ConfigError: ``keep_last`` < 0 or ``keep_every`` < 1.
    """
    if not _is_int(keep_last) or keep_last < 0:
        raise ConfigError(f"keep_last must be an int >= 0, got {keep_last!r}")
    if keep_every is not None and (not _is_int(keep_every) or keep_every < 1):
        raise ConfigError(f"keep_every must be an int >= 1 or None, got {keep_every!r}")
    done = sorted(set(complete))
    keep = set(protect) | ({latest} if latest is not None else set())
    keep.update(done[max(0, len(done) - keep_last) :] if keep_last else ())
    if keep_every is not None:
        keep.update(s for s in done if s % keep_every == 0)
    doomed = {s for s in done if s not in keep}
    if done:
        doomed.update(s for s in set(incomplete) - set(done) if s < done[-1] and s not in keep)
    return sorted(doomed)


def prune(
    root: str, keep_last: int, keep_every: int | None = None, *, protect: Collection[int] = (),
    foreign: Collection[int] = (),
) -> list[int]:
    """Delete old steps under ``root`` per ``steps_to_prune``; return those deleted.

    ``foreign``: steps of another run (``ownership.foreign_steps``): neither counted
    towards ``keep_last`` nor deleted.

    A complete step loses its manifest first (becoming incomplete), then its
    directory, so a crash mid-prune never leaves a manifest without shards.
    Run it from one process per root (the root's owner), after ``set_latest``;
    a file or directory that is already gone (another ``prune``, ``ckpt prune``)
    is not an error: the goal, its absence, holds.

    Raises:
        ConfigError: invalid ``keep_last`` or ``keep_every``.
        CheckpointError: ``latest`` is corrupt, or a directory cannot be removed.
    """
    complete = [s for s in complete_steps(root) if s not in foreign]
    protect = {*protect, *foreign}
    doomed = steps_to_prune(complete, incomplete_steps(root), read_latest(root), keep_last, keep_every, protect)
    for step in doomed:
        try:
            if step in complete:
                with contextlib.suppress(FileNotFoundError):  # already gone: no longer complete either way
                    os.unlink(manifest_path(root, step))
                    fsync_dir(step_dir(root, step))
            shutil.rmtree(step_dir(root, step), onerror=_gone_is_fine)
        except OSError as e:
            raise CheckpointError(f"cannot delete step {step} under {root}: {e}") from e
    if doomed:
        fsync_dir(root)
    return doomed


def _gone_is_fine(func: Any, path: str, exc_info: Any) -> None:
    """``rmtree`` error hook: a path that vanished meanwhile is deleted; anything else raises."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
