"""Lustre striping of the shared tier's step directories: detect the filesystem, run ``lfs``.

A checkpoint writes one HDF5 file per rank (N files for N ranks). On Lustre a new
file takes its layout (stripe count and size) from its directory, so the engine
stripes each new step directory of a shared tier before any shard is created in
it (``persist.persist_shared``); on any other filesystem nothing runs and the
layout is the user's business.

Detection reads the mount table, not ``lfs`` on PATH (a login node's ``lfs`` says
nothing about where the checkpoints go): the filesystem of a path is the one
mounted at the longest mount point that contains it (:func:`fstype_of`), and it is
Lustre when that entry's type is ``lustre``. Chosen over ``statfs`` (``f_type ==
0x0BD00BD0``, through ctypes) because it is plain text that tests feed from a fake
file, needs no per-architecture ``struct statfs`` layout, and answers for a
directory that does not exist yet (the tier root before the first checkpoint).

``lfs setstripe`` runs from an argv list with a timeout, never through a shell;
it only speeds up large writes, so a failure is reported and never fails a
checkpoint (the files then get the filesystem's default layout).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Callable, Protocol

from ..errors import CheckpointError, ConfigError

__all__ = ["MAX_STRIPE_COUNT", "Striping", "LustreStriping", "parse_mounts", "fstype_of",
           "check_striping", "stripe_argv"]

MAX_STRIPE_COUNT = 2000  # LOV_MAX_STRIPE_COUNT
_SIZE_RE = re.compile(r"([1-9][0-9]*)([KMG]?)", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class Striping(Protocol):
    """What the engine needs from the filesystem: is this path on Lustre, and stripe a directory."""

    def is_lustre(self, path: str) -> bool:
        """Whether ``path`` (existing or not) is on a Lustre filesystem."""
        ...

    def stripe(self, directory: str, count: int, size: str) -> None:
        """Give ``directory`` this default layout for the files created in it afterwards.

        Raises:
            CheckpointError: the layout could not be set (``lfs`` missing, failed or timed out).
        """
        ...


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """Pure: (mount point, filesystem type) of each line of ``/proc/self/mounts``.

    Octal escapes in the mount point (``\\040`` for a space) are decoded;
    malformed lines are skipped.
    """
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            out.append((point, fields[2]))
    return out


def fstype_of(path: str, mounts: list[tuple[str, str]]) -> str | None:
    """Pure: the type of the filesystem holding absolute ``path``: the entry with the
    longest mount point that is ``path`` or one of its parents (the last such entry
    when one point is mounted over); None when nothing matches."""
    best, best_len = None, -1
    for point, fstype in mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best_len:
            best, best_len = fstype, len(point)
    return best


def _size_problem(size: object) -> str:
    m = _SIZE_RE.fullmatch(size) if isinstance(size, str) else None
    if m is None:
        return "must be a number with an optional K, M or G suffix, such as '4M'"
    n = int(m.group(1)) * _UNIT[m.group(2).upper()]
    return "must be a multiple of 64K below 4G" if n % (64 << 10) or n >= 4 << 30 else ""


def check_striping(where: str, count: int, size: str) -> None:
    """Validate a stripe count and size; ``where`` prefixes the key names in the message.

    Raises:
        ConfigError: count is not -1, 0 or 1..MAX_STRIPE_COUNT, or the size is invalid.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not -1 <= count <= MAX_STRIPE_COUNT:
        raise ConfigError(f"{where}stripe_count={count!r} must be -1 (all OSTs), 0 (do not stripe) "
                          f"or 1..{MAX_STRIPE_COUNT}")
    problem = _size_problem(size)
    if problem:
        raise ConfigError(f"{where}stripe_size={size!r} {problem}")


def stripe_argv(lfs: str, directory: str, count: int, size: str) -> list[str]:
    """Pure: the ``lfs setstripe`` command line (argv, no shell)."""
    return [lfs, "setstripe", "-c", str(count), "-S", size, directory]


class LustreStriping:
    """The real adapter: ``/proc/self/mounts`` and ``lfs setstripe``."""

    def __init__(self, *, mounts: str = "/proc/self/mounts", timeout_s: float = 30.0,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
        self._mounts, self._timeout_s, self._run = mounts, timeout_s, run

    def is_lustre(self, path: str) -> bool:
        """Whether ``path`` is on Lustre per the mount table; False when it cannot be read."""
        try:
            with open(self._mounts, encoding="utf-8", errors="replace") as f:
                mounts = parse_mounts(f.read())
        except OSError:
            return False
        return fstype_of(os.path.realpath(path), mounts) == "lustre"

    def stripe(self, directory: str, count: int, size: str) -> None:
        """Run ``lfs setstripe -c COUNT -S SIZE DIR``.

        Raises:
            CheckpointError: ``lfs`` is not on PATH, exits non-zero (its stderr is in
                the message) or runs past the timeout.
        """
        lfs = shutil.which("lfs")
        if lfs is None:
            raise CheckpointError(f"{directory} is on Lustre but `lfs` is not on PATH")
        argv = stripe_argv(lfs, directory, count, size)
        try:
            proc = self._run(argv, capture_output=True, text=True, timeout=self._timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise CheckpointError(f"`{' '.join(argv)}` timed out after {self._timeout_s:g} s") from None
        except OSError as e:
            raise CheckpointError(f"cannot run `{' '.join(argv)}`: {e.strerror or e}") from e
        if proc.returncode != 0:
            err = (proc.stderr or "").strip().splitlines()
            raise CheckpointError(f"`{' '.join(argv)}` failed (exit {proc.returncode})"
                                  + (f": {err[0]}" if err else ""))
