"""Every rank's checkpoint state → one global state, and a global state → one rank's.

A toolkit checkpoint holds one state per rank (``TrainingState.state_dict()``).
Replicated objects are the same on every rank; a sharded object (registered with
``register_sharded``) holds ``{"shards": {key: 1-D slice}, ...}`` and the state's
``shard_totals[name][key]`` is the global element count. Its slices, concatenated
in rank order, are the global flat tensor; ``shard_layouts[name][key]`` (optional,
docs/sharded-state.md) gives its global ``shape`` and how it was ``split``:

* ``"even"`` (the default): ``shard_range`` — the first ``total % n`` ranks one more;
* ``"rows"``: ``torch.chunk`` on dim 0 of ``shape``, each slice its rows flattened.

A *nested* object (``"nested": True``, FSDP2) names each shard by a "/"-joined path
into its ``"replicated"`` dict, which lacks the sharded leaves; its global state is
``replicated`` with every path filled by its global tensor.

:func:`global_object_state` and :func:`local_object_state` are pure. The one reader
of checkpoint files here is :func:`read_rank_states`.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Sequence

import torch

from ..errors import CheckpointError

__all__ = ["SHARDS", "read_rank_states", "layout_of", "slice_range", "global_object_state",
           "local_object_state", "global_state", "plain_extras"]

SHARDS = "shards"
NESTED = "nested"
REPLICATED = "replicated"


def read_rank_states(root: str, step: int) -> list[dict[str, Any]]:
    """Every rank's state of committed ``step`` under tier root ``root``, in rank order
    (checksums verified). The one place this module reads checkpoint files.

    Raises:
        CheckpointError: no such complete step, a rank's shard is not under this
            root (node-local tiers hold their node's ranks only), or a shard is unreadable.
    """
    from . import manifest as mf
    from .shared_read import read_rank_state

    complete = mf.complete_steps(root)
    if step not in complete:
        have = ", ".join(map(str, complete[-5:])) or "none"
        raise CheckpointError(f"step {step} is not a complete checkpoint under {root} (complete: {have})")
    man = mf.read_manifest(root, step)
    missing = sorted(set(range(man.world_size)) - set(man.shards))
    if missing:
        raise CheckpointError(f"step {step} under {root} lacks the shards of ranks {missing} (a node-local "
                              "tier holds its node's ranks only): export from the shared tier")
    return [read_rank_state(mf.shard_path(root, step, r)) for r in range(man.world_size)]  # L2: deduplicated too


# -- layouts --------------------------------------------------------------------------
def layout_of(state: Mapping[str, Any], name: str, key: str) -> dict[str, Any]:
    """Pure: the layout of sharded ``name[key]`` recorded in ``state`` (default: 1-D even)."""
    total = int(state.get("shard_totals", {}).get(name, {}).get(key, -1))
    lay = state.get("shard_layouts", {}).get(name, {}).get(key)
    if lay is None:
        return {"shape": [total], "split": "even"}
    return {"shape": [int(s) for s in lay["shape"]], "split": lay.get("split", "even")}


def slice_range(layout: Mapping[str, Any] | None, total: int, world: int, rank: int) -> tuple[int, int]:
    """Pure: ``[start, end)`` in elements of ``rank``'s slice of a global flat tensor of
    ``total`` elements with ``layout`` ``{"shape": [...], "split": "even" | "rows"}``
    (None: even). "even": the first ``total % world`` ranks hold one element more
    (``reshard.shard_range``). "rows": ``torch.chunk`` on dim 0 of ``shape`` (as FSDP2
    shards): ``ceil(rows / world)`` rows per rank, the last ranks fewer or none, the
    slice being those rows' elements in row-major order."""
    if world < 1 or not 0 <= rank < world or total < 0:
        raise ValueError(f"slice_range(total={total}, world={world}, rank={rank})")
    split = (layout or {}).get("split", "even")
    if split == "even":
        base, extra = divmod(total, world)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)
    shape = [int(d) for d in layout.get("shape", [])]
    row = math.prod(shape[1:]) if shape else 1
    if split != "rows" or not shape or shape[0] * row != total:
        raise ValueError(f"slice_range(layout={dict(layout)}, total={total}, world={world}, rank={rank})")
    chunk = -(-shape[0] // world)
    first = min(rank * chunk, shape[0])
    return first * row, min(first + chunk, shape[0]) * row


# -- global <- ranks ------------------------------------------------------------------
def _set_path(tree: dict, path: str, value: Any) -> None:
    parts = path.split("/")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _get_path(tree: Mapping, path: str) -> Any:
    node: Any = tree
    for p in path.split("/"):
        node = node[p]
    return node


def global_object_state(rank_states: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """Pure: the full (global) state of object ``name`` from every rank's checkpoint state.

    Replicated: rank 0's. Sharded: each key's slices concatenated in rank order,
    reshaped to its layout's shape; nested: ``replicated`` filled with those tensors.

    Raises:
        CheckpointError: the object is missing, or the slices do not add up to the total.
    """
    if not rank_states:
        raise CheckpointError("no rank states to globalize")
    first = rank_states[0]
    objs = first.get("objects", {})
    if name not in objs:
        raise CheckpointError(f"the checkpoint has no object {name!r} (it has {', '.join(objs) or 'none'})")
    obj = objs[name]
    if name not in first.get("shard_totals", {}):
        return obj
    glob = {}
    for key in obj[SHARDS]:
        parts = [st["objects"][name][SHARDS][key].reshape(-1) for st in rank_states]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        lay = layout_of(first, name, key)
        total = int(first["shard_totals"][name].get(key, flat.numel()))
        if flat.numel() != total or math.prod(lay["shape"]) not in (total, -1):
            raise CheckpointError(f"{name}[{key!r}]: {len(parts)} slices hold {flat.numel()} elements, "
                                  f"the checkpoint says {total} (shape {lay['shape']})")
        glob[key] = flat.reshape(lay["shape"]) if lay["shape"] != [-1] else flat
    if obj.get(NESTED):
        full = copy.deepcopy(dict(obj[REPLICATED]))
        for path, t in glob.items():
            _set_path(full, path, t)
        return full
    return dict(obj, **{SHARDS: glob})


def plain_extras(extras: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: the extras a plain loader can read: tensors, numbers, strings, bools,
    None, and lists/dicts of them (tuples as lists); others are left out."""
    def plain(v: Any) -> bool:
        if isinstance(v, (torch.Tensor, int, float, str, bool)) or v is None:
            return True
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        return False

    def conv(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return {k: conv(v) for k, v in extras.items() if isinstance(k, str) and plain(v)}


def global_state(rank_states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Pure: ``{object name: full state, "step", "position", "extras"}`` of a checkpoint.

    Raises:
        CheckpointError: as :func:`global_object_state`.
    """
    if not rank_states:
        raise CheckpointError("no rank states to globalize")
    first = rank_states[0]
    out: dict[str, Any] = {n: global_object_state(rank_states, n) for n in first.get("objects", {})}
    for reserved in ("step", "position", "extras"):
        if reserved in out:
            raise CheckpointError(f"an object is named {reserved!r}, a key the export reserves")
    out["step"] = int(first["step"])
    out["position"] = int(first.get("position", 0))
    out["extras"] = plain_extras(first.get("extras", {}))
    return out


# -- global -> one rank ---------------------------------------------------------------
def local_object_state(full: Mapping[str, Any], template: Mapping[str, Any], totals: Mapping[str, int] | None,
                       layouts: Mapping[str, Mapping[str, Any]] | None, world: int, rank: int) -> dict[str, Any]:
    """Pure: ``rank``'s state of a sharded object from its ``full`` state.

    ``template`` is the live object's ``state_dict()`` (which keys are sharded, nested
    or not); ``layouts[key]`` as in :func:`layout_of` (default: 1-D even over the
    global tensor). Non-sharded entries come from ``full``.

    Raises:
        CheckpointError: ``full`` lacks a sharded key.
    """
    layouts = layouts or {}
    shards = {}
    for key in template[SHARDS]:
        try:
            g = _get_path(full, key) if template.get(NESTED) else full[SHARDS][key]
        except (KeyError, TypeError):
            raise CheckpointError(f"the full state lacks sharded key {key!r}") from None
        flat = g.reshape(-1)
        lay = layouts.get(key, {"shape": [flat.numel()], "split": "even"})
        a, b = slice_range(lay, flat.numel(), world, rank)
        shards[key] = flat[a:b].clone()
    if template.get(NESTED):
        rep = copy.deepcopy(dict(full))
        for key in template[SHARDS]:
            parts = key.split("/")
            node = rep
            for p in parts[:-1]:
                node = node[p]
            del node[parts[-1]]
        return dict(template, **{REPLICATED: rep, SHARDS: shards})
    return dict(full, **{SHARDS: shards})
