"""Storage backends for checkpoint tiers: a minimal Protocol, registered by name.

Keys are relative POSIX paths ("step_00000100/rank_0003.h5"); a key may not be
absolute nor climb out with "..". Backends:

    memory  MemoryStorage: a dict; host-memory tier and the test fake
    local   LocalDirStorage: a directory on node-local disk
    shared  LocalDirStorage: a directory on the parallel filesystem

Writes through :class:`LocalDirStorage` are atomic and private (mode 0600 files,
0700 directories): a reader sees the old object or the whole new one.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import subprocess
from typing import Callable, Protocol, runtime_checkable

from slurm_resilience.errors import CheckpointError, ConfigError
from slurm_resilience.files import makedirs_private, write_private

__all__ = [
    "Storage",
    "LocalDirStorage",
    "MemoryStorage",
    "register_storage",
    "get_storage",
    "storage_names",
    "set_lustre_striping",
]

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp-"  # files.write_private's temporaries: never listed


@runtime_checkable
class Storage(Protocol):
    """Where a tier keeps its objects. Every method raises CheckpointError on failure."""

    @property
    def root(self) -> str:
        """Where the objects live ("memory://" for the in-memory backend)."""
        ...

    def write_bytes(self, relpath: str, data: bytes) -> None:
        """Store ``data`` under ``relpath`` atomically, replacing any old object."""
        ...

    def read_bytes(self, relpath: str) -> bytes:
        """The object's bytes; CheckpointError when it does not exist."""
        ...

    def exists(self, relpath: str) -> bool:
        """Whether an object is stored under ``relpath``."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` (a plain string prefix), sorted."""
        ...

    def delete(self, relpath: str) -> None:
        """Remove the object; CheckpointError when it does not exist."""
        ...


def _key(relpath: str) -> str:
    """Normalized key, or CheckpointError for an absolute/escaping/empty one."""
    if not isinstance(relpath, str) or not relpath or relpath.startswith("/") or "\\" in relpath:
        raise CheckpointError(f"storage key {relpath!r} must be a non-empty relative POSIX path")
    key = posixpath.normpath(relpath)
    if key in (".", "..") or key.startswith("../"):
        raise CheckpointError(f"storage key {relpath!r} escapes the storage root")
    if posixpath.basename(key).startswith(_TMP_PREFIX):
        raise CheckpointError(f"storage key {relpath!r}: names starting with {_TMP_PREFIX!r} are reserved")
    return key


class MemoryStorage:
    """Objects in a dict: the host-memory tier and the fake for tests. Not shared between instances."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}

    @property
    def root(self) -> str:
        return "memory://"

    def write_bytes(self, relpath: str, data: bytes) -> None:
        self._objects[_key(relpath)] = bytes(data)

    def read_bytes(self, relpath: str) -> bytes:
        key = _key(relpath)
        if key not in self._objects:
            raise CheckpointError(f"no object {key!r} in memory storage")
        return self._objects[key]

    def exists(self, relpath: str) -> bool:
        return _key(relpath) in self._objects

    def list(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self._objects if k.startswith(prefix))

    def delete(self, relpath: str) -> None:
        key = _key(relpath)
        if key not in self._objects:
            raise CheckpointError(f"cannot delete {key!r}: no such object in memory storage")
        del self._objects[key]


class LocalDirStorage:
    """Objects as files under a directory (node-local disk or a parallel filesystem).

    Directories it creates are mode 0700; files are written by
    :func:`slurm_resilience.files.write_private` (temporary file, fsync, rename).
    Deleting the last object of a directory removes the empty directories up to root.
    """

    def __init__(self, root: str) -> None:
        if not root:
            raise ConfigError("LocalDirStorage needs a root directory")
        self._root = os.path.abspath(root)

    @property
    def root(self) -> str:
        return self._root

    def _path(self, relpath: str) -> str:
        return os.path.join(self._root, *_key(relpath).split("/"))

    def _makedirs(self, directory: str) -> None:
        makedirs_private(directory)

    def write_bytes(self, relpath: str, data: bytes) -> None:
        path = self._path(relpath)
        try:
            self._makedirs(os.path.dirname(path))
            write_private(path, bytes(data))
        except OSError as exc:
            raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def read_bytes(self, relpath: str) -> bytes:
        path = self._path(relpath)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise CheckpointError(f"no object {relpath!r} under {self._root}") from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def exists(self, relpath: str) -> bool:
        return os.path.isfile(self._path(relpath))

    def list(self, prefix: str = "") -> list[str]:
        keys = []
        for dirpath, dirnames, filenames in os.walk(self._root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, self._root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            names = (base + f for f in filenames if not f.startswith(_TMP_PREFIX))
            keys += [k for k in names if k.startswith(prefix)]
        return sorted(keys)

    def delete(self, relpath: str) -> None:
        path = self._path(relpath)
        if not os.path.isfile(path):
            raise CheckpointError(f"cannot delete {relpath!r}: no such object under {self._root}")
        try:
            os.unlink(path)
            directory = os.path.dirname(path)
            while directory != self._root and not os.listdir(directory):
                os.rmdir(directory)
                directory = os.path.dirname(directory)
        except OSError as exc:
            raise CheckpointError(f"cannot delete {path}: {exc.strerror or exc}") from exc


_REGISTRY: dict[str, Callable[..., Storage]] = {}


def register_storage(name: str, factory: Callable[..., Storage], *, replace: bool = False) -> None:
    """Make ``get_storage(name, **kw)`` call ``factory(**kw)``.

    Raises:
        ConfigError: the name is taken and ``replace`` is False.
    """
    if name in _REGISTRY and not replace:
        raise ConfigError(f"storage backend {name!r} is already registered: pass replace=True to override")
    _REGISTRY[name] = factory


def get_storage(name: str, **kw: object) -> Storage:
    """A new backend instance by name ("memory", "local", "shared", or registered ones).

    Raises:
        ConfigError: unknown name (the known ones are listed).
    """
    if name not in _REGISTRY:
        raise ConfigError(f"unknown storage backend {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kw)


def storage_names() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_REGISTRY)


def set_lustre_striping(path: str, stripe_count: int = -1, *, timeout_s: float = 30.0) -> bool:
    """Stripe ``path`` over ``stripe_count`` OSTs (-1: all) with ``lfs setstripe -c``.

    Striping only speeds up large shared writes, so it never fails a checkpoint:
    returns True when ``lfs`` ran and succeeded, False when ``lfs`` is not on PATH
    or refused (not a Lustre path, timeout; logged as a warning).

    Raises:
        ConfigError: stripe_count is neither -1 nor >= 1.
    """
    if stripe_count != -1 and stripe_count < 1:
        raise ConfigError(f"stripe_count={stripe_count} must be -1 (all OSTs) or >= 1")
    lfs = shutil.which("lfs")
    if lfs is None:
        return False
    argv = [lfs, "setstripe", "-c", str(stripe_count), path]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        log.warning("`%s` timed out after %gs; %s keeps its default striping", " ".join(argv), timeout_s, path)
        return False
    if proc.returncode != 0:
        log.warning("`%s` failed (exit %d): %s", " ".join(argv), proc.returncode, proc.stderr.strip())
        return False
    return True


register_storage("memory", MemoryStorage)
register_storage("local", LocalDirStorage)
register_storage("shared", LocalDirStorage)
