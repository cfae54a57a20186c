"""The bulk bytes of a shard: parallel positional I/O with CRC32 computed on the way.

``hdf5_format`` lets h5py lay out the file (metadata, one contiguous dataset per
tensor, allocated up front) and then moves the tensors' bytes itself, straight
between the tensors' memory and the datasets' file offsets::

    write: chunk ──pwrite──▶ page cache ──sync_file_range──▶ disk (started early)
             └──crc32 (same piece, still in the CPU cache)
           direct: chunk ──crc32──▶ ──pwrite, O_DIRECT──▶ disk (DMA from the tensor's memory)
    read:  file ──preadv──▶ the final tensor buffer ──crc32

Every chunk is a task for a small thread pool; os.pwrite/os.preadv and
zlib.crc32 release the GIL, so copying, checksumming and the disk's writes
overlap across cores, and the final fsync finds little left to do. Per-chunk
checksums are joined with :func:`crc32_combine`, so the result is the CRC32 of
the whole buffer, as if computed in one call.

Direct writes (``write_extents(direct_fd=...)``, ``write_shard(direct=True)``; the
engine does not use them, see ``hdf5_format.write_shard``) skip the page cache: no
copy into it and no page-cache memory to allocate. A chunk goes direct when its
file offset and memory address are multiples of :data:`ALIGN` (``hdf5_format``
aligns large datasets in the file, ``hdf5_extents.aligned_empty`` allocates such
memory); its unaligned tail, and everything on a filesystem that refuses O_DIRECT
(EINVAL), is written buffered. The caller still fsyncs.

:func:`crc32` is ISA-L's (package ``isal``) when it is installed: the same values
as ``zlib.crc32`` (the format does not change), about five times faster with
PCLMUL; without it, zlib's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

try:
    from isal.isal_zlib import crc32

    CRC32_IMPL = "isal"
except ImportError:  # optional: zlib's CRC32 gives the same values, slower
    from zlib import crc32

    CRC32_IMPL = "zlib"

__all__ = ["IO_THREADS", "CHUNK", "ALIGN", "CRC32_IMPL", "crc32", "crc32_combine", "open_direct", "write_extents",
           "read_extents", "crc_extents"]

IO_THREADS = max(4, min(8, os.cpu_count() or 4))  # >= 4: writes and faults block, too
CHUNK = 8 << 20  # bytes per task: big enough for few syscalls, small enough to stay in cache for the CRC
_STEP = 1 << 20  # inside a chunk: copy and CRC this much at a time, so the second pass hits the cache
WRITEBACK_EVERY = 32 << 20  # start the disk writing whenever this much more is dirty
ALIGN = 4096  # O_DIRECT: file offset, memory address and length in multiples of this (any block size up to 4 KiB)
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux): start writeback of a range without waiting."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


# -- CRC32 of a concatenation (zlib's crc32_combine, which Python does not expose) ---------


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=1)
def _zero_byte_operators() -> tuple[tuple[int, ...], ...]:
    """Item k: the GF(2) operator that appends 2**k zero bytes to a CRC32 (k < 64)."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # -> one zero byte
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = []
    for _ in range(64):
        ops.append(tuple(op))
        op = [_gf2_times(op, op[n]) for n in range(32)]
    return tuple(ops)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B), as zlib's crc32_combine (not in Python)."""
    ops = _zero_byte_operators()
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


# -- parallel positional I/O -------------------------------------------------------------


def _run(sizes: Sequence[int], work: Callable[[int, int, int], int], threads: int | None,
         chunk: int | None) -> list[int]:
    """Run ``work(buffer index, start, length)`` per chunk in a pool (defaults: IO_THREADS
    threads, CHUNK bytes); join the chunk CRCs of each buffer in order."""
    threads, chunk = threads or IO_THREADS, chunk or CHUNK
    tasks = [(i, s, min(chunk, n - s)) for i, n in enumerate(sizes) for s in range(0, n, chunk)]
    if len(tasks) <= 1 or threads <= 1:
        crcs = [work(*t) for t in tasks]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(tasks)), thread_name_prefix="sr-shard-io") as pool:
            crcs = list(pool.map(lambda t: work(*t), tasks))
    out = [0] * len(sizes)
    for (i, start, n), crc in zip(tasks, crcs):
        out[i] = crc if start == 0 else crc32_combine(out[i], crc, n)
    return out


def open_direct(path: str, flags: int) -> int | None:
    """An O_DIRECT descriptor of ``path`` (``flags`` as os.open's), or None where the
    platform or the filesystem has none (tmpfs before Linux 6.6, some FUSE mounts).

    Raises:
        OSError: any other failure to open (missing file, permissions).
    """
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _address(view: memoryview) -> int:
    """The memory address of a buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_extents(fd: int, extents: Sequence[tuple[int, memoryview]], *, threads: int | None = None,
                  chunk: int | None = None, direct_fd: int | None = None) -> list[int]:
    """Write each byte buffer at its file offset; return each buffer's CRC32.

    With ``direct_fd`` (an O_DIRECT descriptor of the same file, ``open_direct``)
    each chunk whose file offset and memory address are multiples of ALIGN goes
    direct, all but its unaligned tail; if the filesystem refuses a direct write
    (EINVAL) the rest goes buffered. Buffered bytes: the disk starts writing back
    whenever another WRITEBACK_EVERY bytes are written (the caller still fsyncs,
    which then finds little left). ``extents`` holds (offset, 1-D byte memoryview) pairs.

    Raises:
        OSError: a write fails (disk full, I/O error).
    """
    sizes = [len(v) for _, v in extents]
    lock = threading.Lock()
    dirty = [0]
    direct = [direct_fd]  # None once the filesystem refused a direct write
    bases = [_address(v) if direct_fd is not None and len(v) else -1 for _, v in extents]

    def write_direct(view: memoryview, offset: int) -> int:
        """Bytes of ``view`` written direct from its start (0: none, write it buffered)."""
        body = len(view) - len(view) % ALIGN
        dfd = direct[0]
        if dfd is None or body == 0:
            return 0
        try:
            _pwrite_all(dfd, view[:body], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            direct[0] = None  # refused (alignment rules stricter than ours): buffered from now on
            return 0
        return body

    def work(i: int, start: int, n: int) -> int:
        offset, view = extents[i]
        if bases[i] >= 0 and (bases[i] + start) % ALIGN == 0 and (offset + start) % ALIGN == 0:
            piece = view[start:start + n]
            crc = crc32(piece)  # the whole chunk first: DMA does not pass through the CPU cache
            body = write_direct(piece, offset + start)
            _pwrite_all(fd, piece[body:], offset + start + body)  # the tail; all of it when refused
            n -= body
        else:
            crc = 0
            for s in range(start, start + n, _STEP):  # CRC then copy while the piece is in cache
                piece = view[s:min(s + _STEP, start + n)]
                crc = crc32(piece, crc)
                _pwrite_all(fd, piece, offset + s)
        with lock:  # n: the bytes written buffered
            dirty[0] += n
            kick = dirty[0] >= WRITEBACK_EVERY
            dirty[0] = 0 if kick else dirty[0]
        if kick and _sync_file_range is not None:  # a hint, never waits: errors surface at fsync
            _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # whole file: few, large disk requests
        return crc

    return _run(sizes, work, threads, chunk)


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise OSError(f"file ends at offset {offset + done}, {len(buf) - done} bytes short")
        done += got


def read_extents(fd: int, extents: Sequence[tuple[int, memoryview]], *, threads: int | None = None,
                 chunk: int | None = None) -> list[int]:
    """Fill each writable byte buffer from its file offset; return each buffer's CRC32.

    Raises:
        OSError: a read fails or the file is shorter than an extent.
    """
    sizes = [len(v) for _, v in extents]

    def work(i: int, start: int, n: int) -> int:
        offset, view = extents[i]
        crc = 0
        for s in range(start, start + n, _STEP):  # copy then CRC while the piece is in cache
            piece = view[s:min(s + _STEP, start + n)]
            _pread_exact(fd, piece, offset + s)
            crc = crc32(piece, crc)
        return crc

    return _run(sizes, work, threads, chunk)


def crc_extents(fd: int, extents: Sequence[tuple[int, int]], *, threads: int | None = None,
                chunk: int | None = None) -> list[int]:
    """CRC32 of each (offset, length) range of the file, read through small scratch buffers.

    Raises:
        OSError: a read fails or the file is shorter than an extent.
    """
    sizes = [n for _, n in extents]

    def work(i: int, start: int, n: int) -> int:
        buf, crc = memoryview(bytearray(min(n, _STEP))), 0
        for s in range(start, start + n, _STEP):
            piece = buf[:min(_STEP, start + n - s)]
            _pread_exact(fd, piece, extents[i][0] + s)
            crc = crc32(piece, crc)
        return crc

    return _run(sizes, work, threads, chunk)
