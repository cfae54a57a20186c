"""FSDP2 state dicts as the toolkit's sharded convention, and back (pure tree work).

``get_state_dict`` (torch.distributed.checkpoint.state_dict) gives an FSDP2 model's and
optimizer's state as nested dicts keyed by parameter FQN whose sharded leaves are
DTensors placed ``(Shard(0),)`` on a 1-D mesh, split like ``torch.chunk`` on dim 0.
:func:`split_tree` turns such a dict into the nested object state of the shared
contract (docs/fsdp.md)::

    {"nested": True,
     "shards":  {"state/0.weight/exp_avg": 1-D local slice, ...},   # "/"-joined paths
     "layouts": {"state/0.weight/exp_avg": {"shape": [7, 5], "split": "rows"}, ...},
     "replicated": the same nested dict without the sharded leaves}

so the existing sharded machinery (checkpoints of every tier, ``reshard.py``) carries
it unchanged; :func:`join_tree` puts slices back into the nested dict through a
caller-given ``make(path, flat, layout)`` (which builds the DTensor).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..errors import ResilienceError


__all__ = [
    "SEP", "NESTED", "REPLICATED", "ROWS", "check_placement", "split_tree", "join_tree", "shard_full_leaves",
    "local_shape", "contiguous_stride"
]


SEP = "/"
NESTED = "nested"
REPLICATED = "replicated"
ROWS = "rows"


def _dtensor_types():
    from torch.distributed.tensor import DTensor, Shard

    return DTensor, Shard


def check_placement(path: str, leaf: Any, what: str) -> None:
    """A ResilienceError unless ``leaf`` is a DTensor sharded ``(Shard(0),)`` on a 1-D mesh."""
    dtensor, shard = _dtensor_types()
    if not isinstance(leaf, dtensor):
        raise ResilienceError(f"{what}: {path!r} is a {type(leaf).__name__}, not a DTensor; "
                              "apply fully_shard to the model, the root module included")
    mesh = leaf.device_mesh
    if mesh.ndim != 1 or tuple(leaf.placements) != (shard(0),):
        raise ResilienceError(f"{what}: {path!r} is placed {tuple(leaf.placements)} on a {mesh.ndim}-D mesh; "
                              "only fully_shard on a 1-D mesh (Shard(0)) is supported, not HSDP or 2-D meshes")


def split_tree(tree: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The nested object state of ``tree``: its DTensor leaves as flat local slices."""
    dtensor, _ = _dtensor_types()
    shards: dict[str, torch.Tensor] = {}
    layouts: dict[str, dict[str, Any]] = {}

    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, dtensor):
            check_placement(prefix, node, what)
            local = node.to_local().detach()
            shards[prefix] = local.reshape(-1)
            layouts[prefix] = {"shape": [int(d) for d in node.shape], "split": ROWS}
            return None
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if not isinstance(k, str) or SEP in k:
                    raise ResilienceError(f"{what}: key {k!r} under {prefix or 'the root'!r} is not a string "
                                          f"without {SEP!r}; cannot address it in a sharded checkpoint")
                path = f"{prefix}{SEP}{k}" if prefix else k
                child = walk(v, path)
                if child is not None or not isinstance(v, dtensor):
                    out[k] = child
            return out
        if isinstance(node, (list, tuple)) and any(isinstance(x, dtensor) for x in node):
            raise ResilienceError(f"{what}: DTensors inside a list at {prefix!r} are not supported")
        return node

    replicated = walk(dict(tree), "")
    return {NESTED: True, "shards": shards, "layouts": layouts, REPLICATED: replicated}


def join_tree(state: Mapping[str, Any], make: Callable[[str, torch.Tensor, Mapping[str, Any]], Any]) -> dict:
    """The nested dict of a nested object state, each shard path filled by ``make``."""
    if not state.get(NESTED):
        raise ResilienceError("FSDP state: not a nested object state (was it saved by session.fsdp?)")
    out = _copy(state[REPLICATED])
    layouts = state.get("layouts") or {}
    for path, flat in state["shards"].items():
        keys = path.split(SEP)
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = make(path, flat, layouts.get(path) or {"shape": [int(flat.numel())], "split": "even"})
    return out


def shard_full_leaves(state: Mapping[str, Any], shapes: Mapping[str, Any], world: int, rank: int) -> dict:
    """Pure: a nested object state whose ``replicated`` dict holds full (global) plain
    tensors where a parameter's sharded leaves go (an imported state, ``checkpoint.init_from``:
    the template had no such key yet, e.g. an optimizer before its first step), with each
    of them moved into ``shards`` as ``rank``'s ``torch.chunk`` rows of ``world``.

    A leaf goes when it sits at a parameter's FQN (model) or at ``state/FQN/NAME``
    (optimizer), has at least one dimension and the parameter's global shape
    (``shapes[FQN]``); all others (``step``, buffers, param groups) stay replicated.
    """
    from ..checkpoint.globalize import slice_range

    shards, layouts = dict(state["shards"]), dict(state.get("layouts") or {})

    def walk(node: Any, parts: list[str]) -> Any:
        if isinstance(node, dict):
            return {k: v for k, v in ((k, walk(v, [*parts, k])) for k, v in node.items()) if v is not _GONE}
        fqn = parts[0] if len(parts) == 1 else parts[1] if len(parts) == 3 and parts[0] == "state" else None
        if fqn not in shapes or type(node) is not torch.Tensor or node.dim() == 0 \
                or list(node.shape) != [int(d) for d in shapes[fqn]]:
            return node
        path = SEP.join(parts)
        layout = {"shape": [int(d) for d in node.shape], "split": ROWS}
        a, b = slice_range(layout, node.numel(), world, rank)
        shards[path], layouts[path] = node.reshape(-1)[a:b].clone(), layout
        return _GONE

    replicated = walk(state[REPLICATED], [])
    return dict(state, shards=shards, layouts=layouts, **{REPLICATED: replicated})


_GONE = object()


def _copy(node: Any) -> Any:
    return {k: _copy(v) for k, v in node.items()} if isinstance(node, dict) else node


def local_shape(layout: Mapping[str, Any], world: int, rank: int) -> list[int]:
    """Pure: the shape of ``rank``'s ``torch.chunk`` rows of a "rows" layout."""
    shape = [int(d) for d in layout["shape"]]
    chunk = -(-shape[0] // world)
    first = min(rank * chunk, shape[0])
    return [min(first + chunk, shape[0]) - first, *shape[1:]]


def contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    """Pure: the strides torch gives a contiguous tensor of ``shape``."""
    return tuple(torch.empty(shape, device="meta").stride())
