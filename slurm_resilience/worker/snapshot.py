"""A simple node-local snapshot of a rank's state, for the fallback relaunch.

Written atomically (temporary name, fsync, rename, fsync of the directory) and
private (0600 files in a 0700 directory), so a killed writer never leaves a file
that looks complete. The multi-level checkpoint engine replaces this later.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

_NAME = re.compile(r"^snapshot-step(\d{8})\.pt$")


def snapshot_dir(template: str, *, job_id: str, node: str) -> str:
    return template.format(job_id=job_id, node=node)


def atomic_save(state: dict[str, Any], path: str) -> str:
    """torch.save to ``path`` so that it is either absent or complete, and private."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def write_snapshot(directory: str, step: int, state: dict[str, Any], keep: int) -> str:
    final = atomic_save(state, os.path.join(directory, f"snapshot-step{step:08d}.pt"))
    for old in list_snapshots(directory)[:-keep]:
        os.unlink(os.path.join(directory, f"snapshot-step{old:08d}.pt"))
    return final


def list_snapshots(directory: str) -> list[int]:
    """Steps of the complete snapshots in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))


def load_snapshot(directory: str, step: int) -> dict[str, Any]:
    path = os.path.join(directory, f"snapshot-step{step:08d}.pt")
    return torch.load(path, weights_only=False)
