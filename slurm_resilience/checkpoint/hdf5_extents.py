"""Where a shard's tensor bytes sit in the HDF5 file, and moving them past h5py.

Every tensor's dataset is contiguous and allocated when it is created
(:class:`DatasetLayout`), so its file offset is known before any byte is written;
``shard_io``'s thread pool then writes (or reads, :func:`plan_bulk` /
:func:`bulk_read`) the bytes straight between the tensor's memory and that offset,
computing CRC32s on the way. A dataset that is not one plain contiguous run
(another writer's chunked or compressed file) goes through h5py instead
(``hdf5_format``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import h5py
import numpy as np
import torch

from ..errors import CheckpointError
from .shard_io import ALIGN, crc_extents, read_extents

__all__ = ["ALIGN_ABOVE", "DatasetLayout", "raw_extent", "bytes_of", "to_numpy", "to_tensor", "read_target", "Bulk",
           "plan_bulk", "empty", "aligned_empty", "bulk_read", "first_line"]

ALIGN_ABOVE = 64 << 10  # datasets of at least this many bytes start at an ALIGN multiple of the file

# Integer dtypes of each width, to store tensors whose dtype numpy lacks (bfloat16,
# float8 ...) as a same-width view.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DatasetLayout:
    """Creates datasets through h5py's low-level API (a third of the high-level cost per
    dataset): contiguous storage allocated at creation and never filled, so each
    dataset's file offset is known at once and every byte is written exactly once."""

    def __init__(self, f: h5py.File) -> None:
        self.f = f
        self.dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        self.dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        self.dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        self.lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        self.lcpl.set_create_intermediate_group(True)
        self.lcpl.set_char_encoding(h5py.h5t.CSET_UTF8)
        self.u32 = h5py.h5t.py_create(np.dtype(np.uint32))

    def create(self, name: str, arr: np.ndarray, torch_dtype: str | None) -> int | None:
        """Create ``name`` (crc32 attribute 0 for now); its bytes' file offset, or None
        when they are not one plain run (empty, or a dtype stored differently)."""
        space = h5py.h5s.create_simple(arr.shape) if arr.shape else h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(self.f.id, name.encode(), h5py.h5t.py_create(arr.dtype, logical=True), space,
                               dcpl=self.dcpl, lcpl=self.lcpl)
        h5py.h5a.create(dsid, b"crc32", self.u32, h5py.h5s.create(h5py.h5s.SCALAR)).write(np.zeros((), np.uint32))
        if torch_dtype is not None:
            h5py.Dataset(dsid).attrs["torch_dtype"] = torch_dtype
        offset = dsid.get_offset() if arr.nbytes else None
        if offset is None or dsid.get_storage_size() != arr.nbytes:
            if arr.size:
                h5py.Dataset(dsid).write_direct(arr)
            return None
        return offset


def raw_extent(ds: h5py.Dataset, nbytes: int) -> int | None:
    """File offset of a dataset's bytes when they are one plain contiguous run, else None."""
    if nbytes == 0 or ds.id.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS or ds.compression:
        return None
    offset = ds.id.get_offset()
    return offset if offset is not None and ds.id.get_storage_size() == nbytes else None


def bytes_of(arr: np.ndarray) -> memoryview:
    """The array's bytes, flat, without a copy."""
    return memoryview(arr.reshape(-1).view(np.uint8))


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A zero-copy numpy view of a CPU contiguous tensor (copies only if it must), and the
    torch dtype to record when numpy lacks it (stored as a same-width integer view).

    Raises: CheckpointError for a dtype of no integer width.
    """
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    try:
        return t.numpy(), None
    except TypeError:  # numpy has no such dtype (bfloat16, float8 ...)
        width = t.element_size()
        if width not in _INT_OF_WIDTH:
            raise CheckpointError(f"cannot store tensor of dtype {t.dtype}") from None
        return t.view(_INT_OF_WIDTH[width]).numpy(), str(t.dtype).removeprefix("torch.")


def to_tensor(ds: h5py.Dataset, path: str, name: str, arr: np.ndarray) -> torch.Tensor:
    """The tensor of a dataset's array: its recorded torch dtype where numpy lacks it.

    Raises: CheckpointError for an unknown recorded dtype.
    """
    t = torch.from_numpy(arr)
    torch_dtype = ds.attrs.get("torch_dtype")
    if torch_dtype is None:
        return t
    dtype = getattr(torch, str(torch_dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"corrupt shard {path}: dataset {name} has unknown torch_dtype {torch_dtype!r}")
    return t.view(dtype)


def read_target(ds: h5py.Dataset, t: torch.Tensor | None, taken: set[int]) -> torch.Tensor | None:
    """``t`` when the dataset's bytes can be read straight into it: a contiguous CPU
    tensor of the dataset's shape and stored dtype whose storage is not ``taken``
    (data pointers of storages read into already: tied weights come back as two
    tensors, as without ``into``); else None (read into new memory)."""
    if t is None or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != ds.shape \
            or t.is_conj() or t.is_neg() or t.requires_grad or t.numel() == 0 \
            or t.untyped_storage().data_ptr() in taken:
        return None
    try:
        arr, torch_dtype = to_numpy(t)
    except CheckpointError:
        return None
    stored = ds.attrs.get("torch_dtype")
    stored = stored.decode() if isinstance(stored, bytes) else stored
    return t if arr.dtype == ds.dtype and torch_dtype == stored else None


def onto_devices(tensors: dict[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None
                 ) -> dict[str, torch.Tensor]:
    """``tensors`` (read into host memory) with each one that ``into`` holds on an
    accelerator (same shape and dtype) copied into that device tensor and replaced by it:
    a GPU rank's restore lands in its own device tensors, as a CPU rank's is read into
    them in place (``read_target``). One copy per storage (tied weights come back as two
    tensors, as without ``into``); ``into``'s CPU tensors are ``read_target``'s."""
    out, seen = dict(tensors), set()
    for name, t in tensors.items():
        dev = (into or {}).get(name)
        if dev is None or dev.device.type == "cpu" or dev.shape != t.shape or dev.dtype != t.dtype \
                or dev.requires_grad or dev.untyped_storage().data_ptr() in seen:
            continue
        seen.add(dev.untyped_storage().data_ptr())
        dev.copy_(t)  # from pageable host memory: done when it returns, ordered before the stream's next work
        out[name] = dev
    return out


@dataclass
class Bulk:
    """A dataset whose bytes are read past h5py, straight from its file offset."""

    name: str
    offset: int
    nbytes: int
    stored: Any  # the crc32 attribute (None when absent)
    array: np.ndarray | None = None


def plan_bulk(ds: h5py.Dataset, path: str, name: str, allocate: bool) -> Bulk | None:
    """A bulk read for ``name``, or None when h5py must read it (empty, not contiguous ...).

    Raises: CheckpointError when the dataset's metadata is unreadable.
    """
    try:
        nbytes = int(np.prod(ds.shape, dtype=np.int64)) * ds.dtype.itemsize
        offset = raw_extent(ds, nbytes)
        if offset is None:
            return None
        stored = ds.attrs.get("crc32")
        array = empty(ds.shape, ds.dtype, nbytes) if allocate else None
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"corrupt shard {path}: dataset {name} unreadable ({first_line(e)})") from e
    return Bulk(name, offset, nbytes, stored, array)


def empty(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
    """Uninitialized memory from torch's allocator, as a numpy array of ``dtype``. Not
    np.empty: numpy asks for transparent huge pages, and the kernel's synchronous
    compaction for them made some restores several times slower."""
    return torch.empty(nbytes, dtype=torch.uint8).numpy().view(dtype).reshape(shape)


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialized tensor whose memory starts at an ALIGN multiple, so that its
    bytes can be written direct (O_DIRECT, ``shard_io``): a view into ALIGN more
    bytes than it needs."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def bulk_read(path: str, bulk: list[Bulk], *, keep: bool) -> list[int]:
    """CRC32 of every bulk dataset, read in parallel (into its array when ``keep``).

    Raises: CheckpointError when the file cannot be read or is truncated.
    """
    if not bulk:
        return []
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            if keep:
                return read_extents(fd, [(b.offset, bytes_of(b.array)) for b in bulk])
            return crc_extents(fd, [(b.offset, b.nbytes) for b in bulk])
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"corrupt shard {path}: truncated or unreadable ({first_line(e)})") from e


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (h5py's run to many), for one-line errors."""
    return (str(e).splitlines() or [type(e).__name__])[0]
