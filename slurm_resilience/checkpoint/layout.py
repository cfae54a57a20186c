"""Where every file of the checkpoint tree lives: the one module that names them.

One tree per tier root; a tier root is the tier's path template filled in for
this job and rank (:func:`expand_path`)::

    ROOT/                               expand_path(spec, job_id=, node=, rank=, job_dir=);
                                        shared by the G ranks of a node, owned by the
                                        lowest of them (root_owners)
      latest                            latest_path: "100\\n", moved only after the manifest
      step-00000100/                    step_dir (8+ digits; only the canonical name counts)
        rank-00003.h5                   shard_path: one HDF5 shard per rank
        .rank-00003.h5.k2j9x.tmp        a shard being written (shard_temp_prefix, TEMP_SUFFIX)
        xor-00003.bin                   parity_path: rank 3's XOR parity row (L1, xor)
        manifest.json                   manifest_path: the commit record, written last
      partner/                          partner_root: PARTNER copies this node holds for
        latest, step-…/rank-….h5,         other ranks (L1, partner) — a tier root of its
        step-…/manifest.json              own, with the same layout

    JOB_DIR/checkpoints                 job_checkpoints: the default shared (L2) root

Small files (manifest, ``latest``, parity rows, partner copies) are written by
``files.write_private`` through a ``.tmp-*`` temporary in the same directory;
shards through ``.<name>.*.tmp`` (``hdf5_format.write_shard``). Temporaries never
match the names above, so a killed writer leaves nothing that a scan counts.

Pure string functions plus one directory scan (:func:`step_dirs`); importing this
module pulls in neither torch nor h5py, so the ``ckpt`` CLI can use it at once.
"""

from __future__ import annotations

import os
import pwd
import re
from typing import Any, Protocol, Sequence

from ..errors import ConfigError

__all__ = [
    "MANIFEST",
    "LATEST",
    "PARTNER_DIR",
    "JOB_CHECKPOINTS",
    "TEMP_SUFFIX",
    "expand_path",
    "root_owners",
    "job_checkpoints",
    "resolve_root",
    "step_dir_name",
    "parse_step_dir_name",
    "step_dir",
    "step_dirs",
    "shard_name",
    "shard_path",
    "shard_temp_prefix",
    "parity_name",
    "parity_path",
    "manifest_path",
    "latest_path",
    "partner_root",
]

MANIFEST = "manifest.json"
LATEST = "latest"
PARTNER_DIR = "partner"
JOB_CHECKPOINTS = "checkpoints"
TEMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(r"step-(\d{8,})")


# --------------------------------------------------------------------------- roots



class TierPath(Protocol):
    """What the path functions read of a tier (``tiers.TierSpec`` has it)."""

    name: str
    storage: str
    path: str | None

def expand_path(spec: TierPath, **values: Any) -> str:
    """The tier root: ``spec.path`` with its placeholders (job_id, node, rank, job_dir) filled in.

    Raises:
        ConfigError: the tier has no path or a placeholder it uses is not given.
    """
    if spec.path is None:
        raise ConfigError(f"tier {spec.name!r}: storage {spec.storage!r} has no path to expand")
    if "user" not in values:
        values["user"] = current_user()
    try:
        return spec.path.format_map(values)
    except KeyError as exc:
        raise ConfigError(f"tier {spec.name!r}: path {spec.path!r} needs a value for {{{exc.args[0]}}}") from None


def current_user() -> str:
    """The name of the user this process runs as (by uid: not from the environment)."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def root_owners(spec: TierPath, nodes: Sequence[str], **values: Any) -> tuple[int, ...]:
    """Pure: for every rank, the lowest rank whose tier root of ``spec`` is the same directory.

    ``nodes[r]`` is rank r's node; ``values`` the other placeholders (job_id, job_dir).
    A node-local root is per node (``{node}`` in its path), so the G ranks of a node
    share it and the node's lowest rank owns it; with ``{rank}`` in the path every
    rank owns its own. The owner alone writes the root's manifests and ``latest``
    and prunes it (docs/checkpoints.md, "Several ranks per node").

    Raises:
        ConfigError: as :func:`expand_path`.
    """
    first: dict[str, int] = {}
    return tuple(first.setdefault(expand_path(spec, **values, node=node, rank=r), r)
                 for r, node in enumerate(nodes))


def job_checkpoints(job_dir: str) -> str:
    """``JOB_DIR/checkpoints``: the shared tier's default root (``checkpoint.shared_dir``)."""
    return os.path.join(job_dir, JOB_CHECKPOINTS)


def resolve_root(path: str) -> str:
    """A tier root given either itself or a job directory (whose ``checkpoints`` is used)."""
    sub = job_checkpoints(path)
    return sub if os.path.isdir(sub) else path


def partner_root(root: str) -> str:
    """``ROOT/partner``: the tier root of the PARTNER copies held under ``root``."""
    return os.path.join(root, PARTNER_DIR)


def latest_path(root: str) -> str:
    """``ROOT/latest``."""
    return os.path.join(root, LATEST)


# --------------------------------------------------------------------------- steps


def step_dir_name(step: int) -> str:
    """``step-{step:08d}``."""
    return f"step-{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step a directory name stands for, or None. Only the canonical name counts:
    ``step-00000001`` is step 1, ``step-1`` is nothing (both must not count)."""
    m = _STEP_RE.fullmatch(name)
    if m is None or step_dir_name(int(m.group(1))) != name:
        return None
    return int(m.group(1))


def step_dir(root: str, step: int) -> str:
    """``ROOT/step-{step:08d}``."""
    return os.path.join(root, step_dir_name(step))


def step_dirs(root: str) -> dict[int, str]:
    """step -> its directory, for every canonical step directory under ``root`` (missing root: {})."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        step = parse_step_dir_name(name)
        if step is not None and os.path.isdir(os.path.join(root, name)):
            out[step] = os.path.join(root, name)
    return out


def manifest_path(root: str, step: int) -> str:
    """``ROOT/step-{step:08d}/manifest.json``."""
    return os.path.join(step_dir(root, step), MANIFEST)


# --------------------------------------------------------------------------- per-rank files


def shard_name(rank: int) -> str:
    """The shard's file name inside its step directory: ``rank-{rank:05d}.h5``."""
    return f"rank-{rank:05d}.h5"


def shard_path(root: str, step: int, rank: int) -> str:
    """``ROOT/step-{step:08d}/rank-{rank:05d}.h5``."""
    return os.path.join(step_dir(root, step), shard_name(rank))


def shard_temp_prefix(path: str) -> str:
    """Prefix of the temporary a shard is written under (``.<name>.``, then random, then
    ``TEMP_SUFFIX``), in the shard's own directory so the final rename is atomic."""
    return f".{os.path.basename(path)}."


def parity_name(rank: int) -> str:
    """The XOR parity file of ``rank`` inside its step directory: ``xor-{rank:05d}.bin``."""
    return f"xor-{rank:05d}.bin"


def parity_path(root: str, step: int, rank: int) -> str:
    """``ROOT/step-{step:08d}/xor-{rank:05d}.bin``."""
    return os.path.join(step_dir(root, step), parity_name(rank))
