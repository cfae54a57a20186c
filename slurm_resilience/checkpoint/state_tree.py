"""A training state as tensors plus a pickled skeleton, and back.

``flatten_state`` walks dicts, lists and tuples and swaps each dense tensor for a
``TensorRef`` naming its dataset; everything else (numpy arrays, RNG states,
custom objects) stays in the skeleton. The skeleton is a pickle: load it only
from checkpoints you wrote, as with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import collections
import pickle
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import CheckpointError

__all__ = ["TensorRef", "flatten_state", "unflatten_state", "refs"]

_OBJECTS = "objects"


@dataclass(frozen=True)
class TensorRef:
    """Placeholder left in the skeleton where a tensor was; ``key`` is its dataset."""

    key: str


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


def refs(skeleton: bytes) -> list[str]:
    """Dataset names the skeleton refers to. Raises whatever unpickling raises."""
    keys: list[str] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, TensorRef):
            keys.append(obj.key)
        elif _is_walked(obj):
            for v in obj.values() if isinstance(obj, dict) else obj:
                walk(v)

    walk(pickle.loads(skeleton))
    return keys


def copies(tensors: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None = None
           ) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` (a held snapshot's, which must stay as they are): into
    ``into``'s tensor of the same name where its shape and dtype match (on the CPU or a
    GPU: a restore lands in the rank's own tensors), else fresh clones."""
    out = {}
    for name, t in tensors.items():
        dst = (into or {}).get(name)
        fits = dst is not None and dst.shape == t.shape and dst.dtype == t.dtype and not dst.requires_grad
        out[name] = dst.copy_(t) if fits else t.clone()
    return out
