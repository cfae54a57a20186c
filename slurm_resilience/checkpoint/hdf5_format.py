"""One rank's checkpoint shard: an HDF5 file with one checksummed dataset per tensor.

Layout of a shard::

    /                        attrs: format="slurm_resilience/1", plus caller attrs
    /__skeleton__            uint8, the pickled state with tensors replaced by refs
    /objects/<path>/<name>   one contiguous dataset per tensor, attrs: crc32
                             (and torch_dtype when numpy lacks the dtype)

``flatten_state`` (``state_tree``) swaps each dense tensor for a ``TensorRef``
naming its dataset; everything else stays in the skeleton, a pickle: load shards
only from checkpoints you wrote, as with ``torch.load(weights_only=False)``.
A tensor referenced twice is stored twice and comes back as two tensors; views
do not keep sharing storage.

h5py writes the layout and the small datasets; every tensor's dataset is
contiguous and allocated at creation, so its bytes are moved past h5py, straight
between the tensor's memory and the file offset, by a thread pool that also
computes the CRC32s on the way (``shard_io``); reads use the same path into
preallocated buffers. Datasets that are not one plain contiguous run (another
writer's files) are read through h5py.

Writes are atomic: a temporary file in the same directory (mode 0600), fsync,
rename, fsync of the directory. A killed writer leaves at most a ``.*.tmp`` file,
never a partial file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Collection, Iterator, Mapping

import h5py
import numpy as np
import torch

from ..errors import CheckpointError
from ..files import fsync_dir, makedirs_private
from .layout import TEMP_SUFFIX, shard_temp_prefix
from .hdf5_extents import (ALIGN_ABOVE, Bulk, DatasetLayout, bulk_read, bytes_of, first_line, onto_devices,
                           plan_bulk, read_target, to_numpy, to_tensor)
from .shard_io import ALIGN, crc32, open_direct, write_extents
from .state_tree import TensorRef, flatten_state, refs, unflatten_state

__all__ = [
    "FORMAT",
    "SKELETON",
    "ShardInfo",
    "TensorRef",
    "flatten_state",
    "unflatten_state",
    "write_shard",
    "write_flat",
    "read_shard",
    "read_datasets",
    "verify_shard",
    "shard_crc32",
    "shard_contents",
    "combine_checksums",
]

FORMAT = "slurm_resilience/1"
SKELETON = "__skeleton__"
_NO_ATTRS: Mapping[str, int | float | str] = MappingProxyType({})
_RESERVED_ATTRS = frozenset({"format"})


@dataclass(frozen=True)
class ShardInfo:
    """A written shard: its path, size in bytes and combined checksum.

    ``crc32`` is ``combine_checksums`` of the per-dataset checksums, so it can be
    recomputed from the file's attributes without reading the data
    (``shard_crc32``).
    """

    path: str
    nbytes: int
    crc32: int


# --------------------------------------------------------------------------- checksums


def combine_checksums(checksums: Mapping[str, int]) -> int:
    """CRC32 over (name, NUL, 4-byte big-endian crc) of every dataset, sorted by name."""
    blob = b"".join(
        name.encode() + b"\0" + (crc & 0xFFFFFFFF).to_bytes(4, "big")
        for name, crc in sorted(checksums.items())
    )
    return crc32(blob)


# --------------------------------------------------------------------------- write




def _check_attrs(attrs: Mapping[str, int | float | str]) -> None:
    for key, value in attrs.items():
        if key in _RESERVED_ATTRS:
            raise CheckpointError(f"shard attribute {key!r} is reserved")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CheckpointError(f"shard attribute {key!r} must be int, float or str, not {type(value).__name__}")


def _write_hdf5(path: str, tensors: Mapping[str, torch.Tensor], skeleton: bytes,
                attrs: Mapping[str, int | float | str], direct: bool) -> dict[str, int]:
    arrays = {name: to_numpy(t) for name, t in tensors.items()}
    extents: dict[str, int] = {}
    checksums: dict[str, int] = {}
    # h5py lays the file out (metadata only, crc32 attributes still 0) and is closed;
    # the bulk bytes then go straight to their offsets from a thread pool (shard_io),
    # the checksums computed on the way, and h5py fills in the attributes. The file
    # keeps its temporary name throughout. Large datasets start at ALIGN multiples, so
    # their bytes can go direct (O_DIRECT) from aligned memory (the engine's buffers).
    with h5py.File(path, "w", libver="latest", locking=False, alignment_threshold=ALIGN_ABOVE,
                   alignment_interval=ALIGN) as f:
        f.attrs["format"] = FORMAT
        for key, value in attrs.items():
            f.attrs[key] = value
        layout = DatasetLayout(f)
        for name, (arr, torch_dtype) in arrays.items():
            offset = layout.create(name, arr, torch_dtype)
            if offset is None:  # written by h5py already
                checksums[name] = crc32(arr)
            else:
                extents[name] = offset
        checksums[SKELETON] = crc32(skeleton)
        f.create_dataset(SKELETON, data=np.frombuffer(skeleton, dtype=np.uint8)).attrs["crc32"] = \
            np.uint32(checksums[SKELETON])
    fd = os.open(path, os.O_WRONLY)
    dfd = open_direct(path, os.O_WRONLY) if direct and extents else None
    try:
        crcs = write_extents(fd, [(off, bytes_of(arrays[name][0])) for name, off in extents.items()],
                             direct_fd=dfd)
        checksums.update(zip(extents, crcs))
        with h5py.File(path, "r+", locking=False) as f:
            for name in arrays:
                obj = h5py.h5o.open(f.id, name.encode())
                h5py.h5a.open(obj, b"crc32").write(np.array(checksums[name], np.uint32))
        os.fsync(fd)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    return checksums


def write_shard(path: str, state: Any, *, attrs: Mapping[str, int | float | str] = _NO_ATTRS,
                direct: bool = False) -> ShardInfo:
    """Write ``state`` to the HDF5 shard ``path`` atomically (mode 0600).

    CUDA tensors are copied to host; CPU contiguous tensors are written from a
    zero-copy view. ``attrs`` become file attributes (``format`` is reserved).
    ``direct``: the bulk bytes of 4 KiB-aligned tensors go O_DIRECT (``shard_io``);
    off by default: not faster on the development box (docs/performance.md), and the
    PARTNER/XOR tiers read the shard back right away, from the page cache.

    Raises:
        CheckpointError: the state cannot be pickled, a dtype cannot be stored, an
            attribute is invalid, or the file cannot be written (disk full ...).
    """
    tensors, skeleton = flatten_state(state)
    return write_flat(path, tensors, skeleton, attrs=attrs, direct=direct)


def write_flat(path: str, tensors: Mapping[str, torch.Tensor], skeleton: bytes, *,
               attrs: Mapping[str, int | float | str] = _NO_ATTRS, direct: bool = False) -> ShardInfo:
    """``write_shard`` of an already flattened state; ``tensors`` may be a subset of the
    skeleton's references (a deduplicated shared-tier shard, ``dedup``: pass
    ``attrs["dedup"]=1`` so ``verify_shard`` accepts the references it lacks).

    Raises:
        CheckpointError: as ``write_shard``.
    """
    _check_attrs(attrs)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        makedirs_private(directory)
        fd, tmp = tempfile.mkstemp(prefix=shard_temp_prefix(path), suffix=TEMP_SUFFIX, dir=directory)
    except OSError as e:
        raise CheckpointError(f"cannot write shard {path}: {e}") from e
    os.close(fd)  # mkstemp made it 0600; h5py reopens it by name and truncates it
    try:
        checksums = _write_hdf5(tmp, tensors, skeleton, attrs, direct)  # fsynced
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write shard {path}: {e}") from e
        raise
    return ShardInfo(path=path, nbytes=os.stat(path).st_size, crc32=combine_checksums(checksums))


# --------------------------------------------------------------------------- read


@contextlib.contextmanager
def _open(path: str) -> Iterator[h5py.File]:
    if not os.path.exists(path):
        raise CheckpointError(f"missing shard {path}")
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise CheckpointError(f"corrupt shard {path}: not HDF5 or truncated ({first_line(e)})") from e
    with f:
        fmt = f.attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode(errors="replace")
        if fmt != FORMAT:
            raise CheckpointError(f"corrupt shard {path}: format attribute is {fmt!r}, expected {FORMAT!r}")
        yield f


def _datasets(f: h5py.File) -> dict[str, h5py.Dataset]:
    found: dict[str, h5py.Dataset] = {}
    f.visititems(lambda name, obj: found.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
    return found


def _read_dataset(ds: h5py.Dataset, path: str, name: str, verify: bool) -> np.ndarray:
    """Through h5py (small or unusual datasets). Raises: CheckpointError on an
    unreadable dataset or a checksum mismatch."""
    try:
        arr = np.empty(ds.shape, dtype=ds.dtype)
        if arr.size:
            ds.read_direct(arr)
        stored = ds.attrs.get("crc32")
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"corrupt shard {path}: dataset {name} unreadable ({first_line(e)})") from e
    if verify:
        _check_crc(path, name, stored, crc32(arr))
    return arr


def _check_crc(path: str, name: str, stored: Any, crc: int) -> None:
    if stored is None:
        raise CheckpointError(f"corrupt shard {path}: dataset {name} has no checksum")
    if crc != int(stored):
        raise CheckpointError(f"corrupt shard {path}: dataset {name} checksum mismatch")


def _attr_value(value: Any) -> int | float | str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if isinstance(value, np.generic) else value


def read_shard(path: str, *, verify: bool = True, into: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[Any, dict[str, int | float | str]]:
    """Read a shard written by ``write_shard``: ``(state, file attributes)``.

    Tensors come back with their original dtype and shape, bit-exact, on the CPU
    unless ``into`` places them. With ``verify`` every dataset's CRC32 is checked.
    Large contiguous datasets are read in parallel straight into their final
    buffers (``shard_io``): the tensors of ``into`` (dataset name -> tensor, as
    ``flatten_state`` names them) where one is a contiguous CPU tensor of the
    dataset's shape and dtype — the state then holds those very tensors, and no
    memory is allocated for them — else new ones; one of ``into``'s on a GPU gets
    the bytes copied in once read, and the state holds it (``onto_devices``).
    After an error, ``into``'s tensors hold undefined bytes.

    Raises:
        CheckpointError: the file is missing, not HDF5, truncated, lacks the format
            attribute, a dataset is unreadable or fails its checksum, or the
            skeleton is corrupt.
    """
    tensors, skeleton, attrs = read_datasets(path, verify=verify, into=into)
    try:
        state = unflatten_state(tensors, skeleton)
    except CheckpointError as e:
        raise CheckpointError(f"corrupt shard {path}: {e}") from e
    return state, attrs


def read_datasets(path: str, names: Collection[str] | None = None, *, verify: bool = True,
                  into: Mapping[str, torch.Tensor] | None = None
                  ) -> tuple[dict[str, torch.Tensor], bytes, dict[str, int | float | str]]:
    """The shard's tensors (only ``names`` when given), its skeleton and attributes;
    ``into`` as in ``read_shard``.

    Raises:
        CheckpointError: as ``read_shard``, or a name in ``names`` is not in the file.
    """
    with _open(path) as f:
        found = _datasets(f)
        if SKELETON not in found:
            raise CheckpointError(f"corrupt shard {path}: no {SKELETON} dataset")
        lacking = sorted(set(names or ()) - set(found))
        if lacking:
            raise CheckpointError(f"corrupt shard {path}: no dataset {lacking[0]}")
        skeleton = _read_dataset(found[SKELETON], path, SKELETON, verify).tobytes()
        arrays: dict[str, np.ndarray] = {}
        given: dict[str, torch.Tensor] = {}  # read into the caller's tensor
        taken: set[int] = set()  # their storages
        bulk: list[Bulk] = []
        wanted = set(found) if names is None else set(names)
        for name, ds in found.items():
            if name == SKELETON or name not in wanted:
                continue
            target = read_target(ds, (into or {}).get(name), taken)
            plan = plan_bulk(ds, path, name, allocate=target is None)
            if plan is None:
                arrays[name] = _read_dataset(ds, path, name, verify)
            else:
                if target is not None:
                    plan.array, given[name] = to_numpy(target)[0], target
                    taken.add(target.untyped_storage().data_ptr())
                bulk.append(plan)
                arrays[name] = plan.array
        attrs = {k: _attr_value(v) for k, v in f.attrs.items() if k not in _RESERVED_ATTRS}
        for b, crc in zip(bulk, bulk_read(path, bulk, keep=True)):
            if verify:
                _check_crc(path, b.name, b.stored, crc)
        tensors = onto_devices({name: given[name] if name in given else to_tensor(found[name], path, name, arr)
                                for name, arr in arrays.items()}, into)
    return tensors, skeleton, attrs



def verify_shard(path: str) -> list[str]:
    """Every problem found in the shard ``path``; an empty list means it is valid.

    Reads each dataset once and checks its CRC32 (large ones in parallel through
    small buffers), then that the skeleton unpickles and names only datasets that
    exist (a dedup shard holds only some: shared_read checks its step). Never raises for a bad file.
    """
    problems: list[str] = []
    try:
        with _open(path) as f:
            names = _datasets(f)
            bulk: list[Bulk] = []
            for name, ds in names.items():
                try:
                    plan = plan_bulk(ds, path, name, allocate=False)
                    if plan is None:
                        _read_dataset(ds, path, name, verify=True)
                    else:
                        bulk.append(plan)
                except CheckpointError as e:
                    problems.append(str(e))
            for b, crc in zip(bulk, bulk_read(path, bulk, keep=False)):
                try:
                    _check_crc(path, b.name, b.stored, crc)
                except CheckpointError as e:
                    problems.append(str(e))
            if SKELETON not in names:
                problems.append(f"corrupt shard {path}: no {SKELETON} dataset")
            elif not problems:
                skeleton = _read_dataset(names[SKELETON], path, SKELETON, verify=True).tobytes()
                try:
                    # a deduplicated shared-tier shard holds only the tensors it owns (dedup.py)
                    missing = [] if f.attrs.get("dedup") == 1 else sorted(set(refs(skeleton)) - set(names))
                except Exception as e:  # unpickling raises almost anything on corrupt input
                    problems.append(f"corrupt shard {path}: skeleton cannot be unpickled ({first_line(e)})")
                else:
                    problems.extend(f"corrupt shard {path}: skeleton names missing dataset {m}" for m in missing)
    except CheckpointError as e:
        problems.append(str(e))
    return problems


def shard_contents(path: str) -> tuple[set[str], list[str]]:
    """(the file's tensor dataset names, the datasets its skeleton names); data unread.

    Raises:
        CheckpointError: the file is missing or corrupt, or the skeleton does not unpickle.
    """
    with _open(path) as f:
        names = set(_datasets(f)) - {SKELETON}
        if SKELETON not in f:
            raise CheckpointError(f"corrupt shard {path}: no {SKELETON} dataset")
        skeleton = _read_dataset(f[SKELETON], path, SKELETON, verify=True).tobytes()
    try:
        return names, refs(skeleton)
    except Exception as e:  # unpickling raises almost anything on corrupt input
        raise CheckpointError(f"corrupt shard {path}: skeleton cannot be unpickled ({first_line(e)})") from e


def shard_crc32(path: str) -> int:
    """The shard's combined checksum from its per-dataset attributes (data unread).

    Raises:
        CheckpointError: the file is missing or corrupt, or a dataset has no checksum.
    """
    with _open(path) as f:
        checksums: dict[str, int] = {}
        for name, ds in _datasets(f).items():
            stored = ds.attrs.get("crc32")
            if stored is None:
                raise CheckpointError(f"corrupt shard {path}: dataset {name} has no checksum")
            checksums[name] = int(stored)
    return combine_checksums(checksums)
