"""One rank's checkpoint shard: an HDF5 file with one checksummed dataset per tensor.

Layout of a shard::

    /                        attrs: format="slurm_resilience/1", plus caller attrs
    /__skeleton__            uint8, the pickled state with tensors replaced by refs
    /objects/<path>/<name>   one contiguous dataset per tensor, attrs: crc32
                             (and torch_dtype when numpy lacks the dtype)

``flatten_state`` walks dicts, lists and tuples and swaps each dense tensor for a
``TensorRef`` naming its dataset; everything else (numpy arrays, RNG states,
custom objects) stays in the skeleton. The skeleton is a pickle: load shards only
from checkpoints you wrote, as with ``torch.load(weights_only=False)``.

A tensor referenced twice is stored twice and comes back as two tensors; views
do not keep sharing storage.

Writes are atomic: a temporary file in the same directory (mode 0600), fsync,
rename, fsync of the directory. A killed writer leaves at most a ``.*.tmp`` file,
never a partial file under the final name.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import h5py
import numpy as np
import torch

from ..errors import CheckpointError
from ..files import fsync_dir, makedirs_private

__all__ = [
    "FORMAT",
    "SKELETON",
    "ShardInfo",
    "TensorRef",
    "flatten_state",
    "unflatten_state",
    "write_shard",
    "read_shard",
    "verify_shard",
    "shard_crc32",
    "combine_checksums",
]

FORMAT = "slurm_resilience/1"
SKELETON = "__skeleton__"
_OBJECTS = "objects"
_NO_ATTRS: Mapping[str, int | float | str] = MappingProxyType({})
_RESERVED_ATTRS = frozenset({"format"})
# Integer dtypes of each width, to store tensors whose dtype numpy lacks (bfloat16,
# float8 ...) as a same-width view.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorRef:
    """Placeholder left in the skeleton where a tensor was; ``key`` is its dataset."""

    key: str


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


# --------------------------------------------------------------------------- state


def _is_walked(obj: Any) -> bool:
    # Only containers we can rebuild exactly; dict subclasses such as defaultdict
    # stay opaque (pickled whole, tensors included).
    return type(obj) in (dict, list, tuple, collections.OrderedDict) or _is_namedtuple(obj)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_storable(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _escape(name: str) -> str:
    """Make one HDF5 path component: no '/', no NUL, never '', '.' or '..'."""
    out = name.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    if out in ("", ".", ".."):
        out = "%" + out.replace(".", "%2E")  # a lone leading '%' cannot come from escaping
    return out


def _component(key: Any) -> str:
    return _escape(key if isinstance(key, str) else repr(key))


def _unique(name: str, used: set[str]) -> str:
    candidate, n = name, 0
    while candidate in used:
        n += 1
        candidate = f"{name}~{n}"
    used.add(candidate)
    return candidate


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], bytes]:
    """Split ``state`` into its tensors, keyed by dataset name, and a pickled skeleton.

    Dataset names are ``objects/<path>`` where each path component is a dict key
    (non-str keys via ``repr``, '/' escaped) or a list/tuple index; siblings whose
    names collide get a ``~N`` suffix, so every name is unique.

    Raises:
        CheckpointError: the skeleton cannot be pickled.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor) and _is_storable(obj):
            tensors[path] = obj
            return TensorRef(path)
        if not _is_walked(obj):
            return obj
        used: set[str] = set()
        if isinstance(obj, dict):
            items = [(k, walk(v, f"{path}/{_unique(_component(k), used)}")) for k, v in obj.items()]
            return type(obj)(items)
        children = [walk(v, f"{path}/{_unique(str(i), used)}") for i, v in enumerate(obj)]
        if _is_namedtuple(obj):
            return type(obj)(*children)
        return type(obj)(children)

    skeleton = walk(state, _OBJECTS)
    try:
        blob = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint state cannot be pickled: {e}") from e
    return tensors, blob


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: bytes) -> Any:
    """Invert ``flatten_state``: unpickle the skeleton and put the tensors back.

    Raises:
        CheckpointError: the skeleton does not unpickle, or names a tensor that
            ``tensors`` lacks.
    """
    try:
        tree = pickle.loads(skeleton)
    except Exception as e:  # unpickling raises almost anything on corrupt input
        raise CheckpointError(f"checkpoint skeleton cannot be unpickled: {e}") from e

    def walk(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            try:
                return tensors[obj.key]
            except KeyError:
                raise CheckpointError(f"checkpoint skeleton names missing tensor {obj.key}") from None
        if not _is_walked(obj):
            return obj
        if isinstance(obj, dict):
            return type(obj)((k, walk(v)) for k, v in obj.items())
        children = [walk(v) for v in obj]
        return type(obj)(*children) if _is_namedtuple(obj) else type(obj)(children)

    return walk(tree)


def _refs(skeleton: bytes) -> list[str]:
    keys: list[str] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, TensorRef):
            keys.append(obj.key)
        elif _is_walked(obj):
            for v in obj.values() if isinstance(obj, dict) else obj:
                walk(v)

    walk(pickle.loads(skeleton))
    return keys


# --------------------------------------------------------------------------- checksums


def combine_checksums(checksums: Mapping[str, int]) -> int:
    """CRC32 over (name, NUL, 4-byte big-endian crc) of every dataset, sorted by name."""
    blob = b"".join(
        name.encode() + b"\0" + (crc & 0xFFFFFFFF).to_bytes(4, "big")
        for name, crc in sorted(checksums.items())
    )
    return zlib.crc32(blob)


# --------------------------------------------------------------------------- write


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A zero-copy numpy view of a CPU contiguous tensor; copies only if it must."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    try:
        return t.numpy(), None
    except TypeError:  # numpy has no such dtype (bfloat16, float8 ...)
        width = t.element_size()
        if width not in _INT_OF_WIDTH:
            raise CheckpointError(f"cannot store tensor of dtype {t.dtype}") from None
        return t.view(_INT_OF_WIDTH[width]).numpy(), str(t.dtype).removeprefix("torch.")


def _check_attrs(attrs: Mapping[str, int | float | str]) -> None:
    for key, value in attrs.items():
        if key in _RESERVED_ATTRS:
            raise CheckpointError(f"shard attribute {key!r} is reserved")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CheckpointError(f"shard attribute {key!r} must be int, float or str, not {type(value).__name__}")


def _write_hdf5(
    path: str, tensors: Mapping[str, torch.Tensor], skeleton: bytes, attrs: Mapping[str, int | float | str]
) -> dict[str, int]:
    checksums: dict[str, int] = {}
    # zlib.crc32 releases the GIL on large buffers: checksum each tensor in a
    # thread while HDF5 writes it, so the checksum costs (almost) no wall time.
    with ThreadPoolExecutor(max_workers=1) as pool, h5py.File(path, "w", libver="latest", locking=False) as f:
        f.attrs["format"] = FORMAT
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, tensor in tensors.items():
            arr, torch_dtype = _to_numpy(tensor)
            crc = pool.submit(zlib.crc32, arr)
            ds = f.create_dataset(name, data=arr)
            checksums[name] = crc.result()
            ds.attrs["crc32"] = np.uint32(checksums[name])
            if torch_dtype is not None:
                ds.attrs["torch_dtype"] = torch_dtype
        blob = np.frombuffer(skeleton, dtype=np.uint8)
        checksums[SKELETON] = zlib.crc32(skeleton)
        f.create_dataset(SKELETON, data=blob).attrs["crc32"] = np.uint32(checksums[SKELETON])
    return checksums


def write_shard(path: str, state: Any, *, attrs: Mapping[str, int | float | str] = _NO_ATTRS) -> ShardInfo:
    """Write ``state`` to the HDF5 shard ``path`` atomically (mode 0600).

    CUDA tensors are copied to host; CPU contiguous tensors are written from a
    zero-copy view. ``attrs`` become file attributes (``format`` is reserved).

    Raises:
        CheckpointError: the state cannot be pickled, a dtype cannot be stored, an
            attribute is invalid, or the file cannot be written (disk full ...).
    """
    _check_attrs(attrs)
    tensors, skeleton = flatten_state(state)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        makedirs_private(directory)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise CheckpointError(f"cannot write shard {path}: {e}") from e
    os.close(fd)  # mkstemp made it 0600; h5py reopens it by name and truncates it
    try:
        checksums = _write_hdf5(tmp, tensors, skeleton, attrs)
        fsync_dir(tmp)
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
        raise CheckpointError(f"corrupt shard {path}: not HDF5 or truncated ({_first_line(e)})") from e
    with f:
        fmt = f.attrs.get("format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode(errors="replace")
        if fmt != FORMAT:
            raise CheckpointError(f"corrupt shard {path}: format attribute is {fmt!r}, expected {FORMAT!r}")
        yield f


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def _read_dataset(f: h5py.File, path: str, name: str, verify: bool) -> np.ndarray:
    """Raises: CheckpointError on an unreadable dataset or a checksum mismatch."""
    try:
        ds = f[name]
        if not isinstance(ds, h5py.Dataset):
            raise CheckpointError(f"corrupt shard {path}: {name} is not a dataset")
        arr = np.empty(ds.shape, dtype=ds.dtype)
        if arr.size:
            ds.read_direct(arr)
        stored = ds.attrs.get("crc32")
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"corrupt shard {path}: dataset {name} unreadable ({_first_line(e)})") from e
    if verify:
        if stored is None:
            raise CheckpointError(f"corrupt shard {path}: dataset {name} has no checksum")
        if zlib.crc32(arr) != int(stored):
            raise CheckpointError(f"corrupt shard {path}: dataset {name} checksum mismatch")
    return arr


def _to_tensor(f: h5py.File, path: str, name: str, arr: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(arr)
    torch_dtype = f[name].attrs.get("torch_dtype")
    if torch_dtype is None:
        return t
    dtype = getattr(torch, str(torch_dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"corrupt shard {path}: dataset {name} has unknown torch_dtype {torch_dtype!r}")
    return t.view(dtype)


def _attr_value(value: Any) -> int | float | str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value.item() if isinstance(value, np.generic) else value


def read_shard(path: str, *, verify: bool = True) -> tuple[Any, dict[str, int | float | str]]:
    """Read a shard written by ``write_shard``: ``(state, file attributes)``.

    Tensors come back on the CPU with their original dtype and shape, bit-exact.
    With ``verify`` every dataset's CRC32 is checked.

    Raises:
        CheckpointError: the file is missing, not HDF5, truncated, lacks the format
            attribute, a dataset is unreadable or fails its checksum, or the
            skeleton is corrupt.
    """
    with _open(path) as f:
        names = _datasets(f)
        if SKELETON not in names:
            raise CheckpointError(f"corrupt shard {path}: no {SKELETON} dataset")
        skeleton = _read_dataset(f, path, SKELETON, verify).tobytes()
        tensors = {
            name: _to_tensor(f, path, name, _read_dataset(f, path, name, verify))
            for name in names
            if name != SKELETON
        }
        attrs = {k: _attr_value(v) for k, v in f.attrs.items() if k not in _RESERVED_ATTRS}
    try:
        state = unflatten_state(tensors, skeleton)
    except CheckpointError as e:
        raise CheckpointError(f"corrupt shard {path}: {e}") from e
    return state, attrs


def verify_shard(path: str) -> list[str]:
    """Every problem found in the shard ``path``; an empty list means it is valid.

    Reads each dataset once (one at a time) and checks its CRC32, then that the
    skeleton unpickles and names only datasets that exist. Never raises for a bad
    file.
    """
    problems: list[str] = []
    try:
        with _open(path) as f:
            names = _datasets(f)
            for name in names:
                try:
                    _read_dataset(f, path, name, verify=True)
                except CheckpointError as e:
                    problems.append(str(e))
            if SKELETON not in names:
                problems.append(f"corrupt shard {path}: no {SKELETON} dataset")
            elif not problems:
                skeleton = _read_dataset(f, path, SKELETON, verify=True).tobytes()
                try:
                    missing = sorted(set(_refs(skeleton)) - set(names))
                except Exception as e:  # unpickling raises almost anything on corrupt input
                    problems.append(f"corrupt shard {path}: skeleton cannot be unpickled ({_first_line(e)})")
                else:
                    problems.extend(f"corrupt shard {path}: skeleton names missing dataset {m}" for m in missing)
    except CheckpointError as e:
        problems.append(str(e))
    return problems


def shard_crc32(path: str) -> int:
    """The shard's combined checksum from its per-dataset attributes (data unread).

    Raises:
        CheckpointError: the file is missing or corrupt, or a dataset has no checksum.
    """
    with _open(path) as f:
        checksums: dict[str, int] = {}
        for name in _datasets(f):
            stored = f[name].attrs.get("crc32")
            if stored is None:
                raise CheckpointError(f"corrupt shard {path}: dataset {name} has no checksum")
            checksums[name] = int(stored)
    return combine_checksums(checksums)
