"""Private, atomic files: either the old content or the whole new one, mode 0600.

Every file the toolkit writes that a reader may pick up while it is being written
(token, config, rank tables, status, results) goes through here: a temporary file
in the same directory (created 0600 by mkstemp), fsync, rename, fsync of the
directory. A crash never leaves a half-written file under the final name, and an
existing world-readable file is replaced, not reused, so it cannot keep its mode.
``durable=False`` skips the two fsyncs (the rename stays atomic): for what only a
process on the same host reads again after a *process* crash (the supervisor's state,
status and metrics, rewritten many times a second), where the page cache survives.
"""

from __future__ import annotations

import os
import tempfile


__all__ = ["makedirs_private", "write_private", "fsync_dir"]


def makedirs_private(directory: str) -> None:
    """Create every missing level of ``directory`` 0700 (os.makedirs applies the mode
    to the last level only)."""
    missing = []
    d = os.path.abspath(directory)
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # the umask may have narrowed it further; never widened


def write_private(path: str, data: str | bytes, *, mode: int = 0o600, durable: bool = True) -> str:
    """Write ``data`` to ``path`` atomically (temp file, rename), private (``mode``); fsynced when ``durable``."""
    directory = os.path.dirname(path) or "."
    makedirs_private(directory)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory)
    return path


def fsync_dir(directory: str) -> None:
    """fsync a directory (or any path opened read-only): makes a rename durable."""
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
