"""Sharded state (ZeRO-style): restore every rank's slice of the newest complete
checkpoint, resharded to the current world size.

Convention for an object registered with ``Session.register_sharded``: its state_dict is

    {"shards": {key: 1-D tensor}, ...replicated entries...}

where ``shards[key]`` on rank r of a world of n is the slice
``shard_range(total, n, r)`` of one global flat tensor of ``total`` elements (the
first ``total % n`` ranks hold one element more). Everything else in the state
(model, other objects, RNG, data position, extras) is replicated.

A sharded slice cannot be rebuilt from survivors alone: the lost rank's slice lives
only in checkpoints. So every recovery of a job with sharded state rolls back to the
newest step whose shards all exist somewhere — on this generation's ranks' node-local
tiers (own shards and partner copies) or on the shared tier — and:

1. each rank publishes what it holds (store, this generation's prefix);
2. every rank computes the same step and a source per old shard (pure, below);
3. sources read their shards (checksums verified); the replicated state, which holds
   each sharded key's global length (``shard_totals``), comes from the source of old
   shard 0 (broadcast);
4. each rank computes the pieces of its new slice (pure) and receives the parts of
   the old shards it needs in one all-to-all (from the shared tier it reads them itself).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..checkpoint import layout
from ..checkpoint.globalize import slice_range  # noqa: F401 (re-exported: reshard.slice_range)
from ..checkpoint.shared_read import read_rank_state
from ..errors import StepAborted
from ..protocol import StoreKey


__all__ = [
    "SHARDS", "LAYOUTS", "SHARED", "shard_range", "layout_of", "shard_meta", "Piece", "plan_pieces", "choose_step",
    "assign_sources", "local_holdings", "old_lengths", "lengths_of", "needed", "restore_sharded"
]


SHARDS = "shards"
LAYOUTS = "layouts"  # optional replicated entry of a sharded object's state: key -> layout
SHARED = -1  # source "rank" of a shard on the shared tier: every rank reads it itself


def shard_range(total: int, world: int, rank: int) -> tuple[int, int]:
    """Pure: ``[start, end)`` of rank's slice of ``total`` elements over ``world`` ranks."""
    if world < 1 or not 0 <= rank < world or total < 0:
        raise ValueError(f"shard_range(total={total}, world={world}, rank={rank})")
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def layout_of(layouts: Mapping[str, Mapping[str, Any]] | None, name: str, key: str) -> Mapping[str, Any] | None:
    """Pure: the layout of ``name[key]`` in a ``shard_layouts`` mapping (None: even)."""
    return ((layouts or {}).get(name) or {}).get(key)


def shard_meta(states: Mapping[str, Mapping[str, Any]], agreed: Mapping[str, Mapping[str, int]]
               ) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, dict[str, Any]]]]:
    """Pure: ``(shard_totals, shard_layouts)`` of sharded objects' states (name -> state).

    A key with a layout has its total from the layout's global shape, so keys that appear
    later (an optimizer's state after its first step) are covered; an "even" key without
    one keeps the total the ranks ``agreed`` on at the last state sync."""
    totals, layouts = {}, {}
    for n, state in states.items():
        lay = dict(state.get(LAYOUTS) or {})
        totals[n] = {}
        for k in state[SHARDS]:
            if k in lay:
                total = 1
                for d in lay[k]["shape"]:
                    total *= int(d)
                totals[n][k] = total
            elif k in agreed.get(n, {}):
                totals[n][k] = agreed[n][k]
        if lay:
            layouts[n] = {k: v for k, v in lay.items() if k in totals[n]}
    return totals, layouts


@dataclasses.dataclass(frozen=True)
class Piece:
    """``count`` elements of old shard ``old_rank`` from ``src`` go to ``dst`` of the new slice."""

    old_rank: int
    src: int
    dst: int
    count: int


def plan_pieces(old_lengths: Sequence[int], new_world: int, new_rank: int,
                layout: Mapping[str, Any] | None = None) -> list[Piece]:
    """Pure: the parts of the old slices (lengths in old-rank order) that form the new one."""
    start, end = slice_range(layout, sum(old_lengths), new_world, new_rank)
    pieces, off = [], 0
    for r, n in enumerate(old_lengths):
        a, b = max(start, off), min(end, off + n)
        if a < b:
            pieces.append(Piece(r, a - off, a - start, b - a))
        off += n
    return pieces


def choose_step(held: Mapping[int, Iterable[Sequence[int]]], shared: Mapping[int, int],
                worlds: Mapping[int, int]) -> int | None:
    """Pure: the newest step whose every old shard is held by a rank or on the shared tier.

    ``held``: new rank → (step, old_rank) pairs on its node; ``shared``: step → world
    size of complete shared-tier steps; ``worlds``: step → world size of that step.
    """
    have: dict[int, set[int]] = {}
    for pairs in held.values():
        for step, old in pairs:
            have.setdefault(step, set()).add(old)
    for step in sorted(set(have) | set(shared), reverse=True):
        n = worlds.get(step, shared.get(step))
        if n is not None and (step in shared or have.get(step, set()) >= set(range(n))):
            return step
    return None


def assign_sources(held: Mapping[int, Iterable[Sequence[int]]], step: int, world: int,
                   on_shared: bool) -> list[int]:
    """Pure: per old shard, the new rank that reads it (lowest holder), or SHARED."""
    if on_shared:
        return [SHARED] * world
    sets = {r: {tuple(p) for p in pairs} for r, pairs in held.items()}
    return [min(r for r, s in sets.items() if (step, old) in s) for old in range(world)]


# -- the collective ----------------------------------------------------------------
def local_holdings(engine) -> tuple[list[tuple[int, int, str]], dict[int, int], dict[int, str]]:
    """(step, old_rank, path) on this node's disk tiers; shared steps → world; shared roots.
    Only this run's steps (``engine.ownership``): another run's are not held."""
    held, shared, roots = [], {}, {}
    for spec in engine.specs:
        if spec.storage == "memory":
            continue
        root = engine.root(spec)
        dirs = [root, layout.partner_root(root)] if spec.storage == "local" else [root]
        for d in dirs:
            if not os.path.isdir(d):
                continue
            for step, man in engine.ownership.own(d, spec.name if d == root else f"{spec.name}-partner"):
                if spec.storage == "shared":
                    shared.setdefault(step, man.world_size)
                    roots.setdefault(step, d)
                else:
                    held += [(step, r, layout.shard_path(d, step, r), man.world_size) for r in man.shards]
    return held, shared, roots


def old_lengths(layout: Mapping[str, Any] | None, total: int, world: int) -> list[int]:
    """Pure: every rank's slice length of one key, in rank order."""
    return [b - a for a, b in (slice_range(layout, total, world, r) for r in range(world))]


def lengths_of(totals: Mapping[str, Mapping[str, int]], world: int,
               layouts: Mapping[str, Mapping[str, Any]] | None = None) -> dict[int, dict[str, dict[str, int]]]:
    """Pure: every old rank's slice lengths from the global totals (the convention)."""
    return {r: {n: {k: (lambda a, b: b - a)(*slice_range(layout_of(layouts, n, k), t, world, r))
                    for k, t in keys.items()}
                for n, keys in totals.items()} for r in range(world)}


def needed(totals: Mapping[str, Mapping[str, int]], old_world: int, new_world: int, rank: int,
           layouts: Mapping[str, Mapping[str, Any]] | None = None) -> set[int]:
    """Pure: the old shards that new ``rank``'s slices draw from."""
    return {p.old_rank for n, keys in totals.items() for k, t in keys.items()
            for p in plan_pieces(old_lengths(layout_of(layouts, n, k), t, old_world), new_world, rank,
                                 layout_of(layouts, n, k))}


def restore_sharded(gen, store, engine, names: Sequence[str]) -> dict[str, Any] | None:
    """Collective over ``gen``: this rank's state at the newest step complete anywhere,
    its sharded objects resharded to ``gen.world_size``; None when there is no such step."""
    engine.rebuild_missing()  # XOR tiers: a lost node's shard rebuilt into its slot's new rank
    held, shared, roots = local_holdings(engine)
    engine.report_foreign()
    store.set(StoreKey.RESHARD_HELD.of(gen.generation, gen.rank), json.dumps([[s, r, w] for s, r, _, w in held]))
    infos = {r: json.loads(_get(store, StoreKey.RESHARD_HELD.of(gen.generation, r), gen))
             for r in range(gen.world_size)}
    all_held = {r: [(s, o) for s, o, _ in i] for r, i in infos.items()}
    worlds = {s: w for i in infos.values() for s, _, w in i}
    step = choose_step(all_held, shared, worlds)
    if step is None:
        return None
    local = {o for pairs in all_held.values() for s, o in pairs if s == step}
    on_shared = not (step in worlds and local >= set(range(worlds[step])))  # node-local first
    old_world = shared[step] if on_shared else worlds[step]
    sources = assign_sources(all_held, step, old_world, on_shared)
    if on_shared:  # every rank reads what it needs itself
        path = lambda old: layout.shard_path(roots[step], step, old)  # noqa: E731
        base = read_rank_state(path(0))  # a dedup step: replicated tensors from their owners' files
        totals, layouts = base["shard_totals"], base.get("shard_layouts")
        olds = {old: base if old == 0 else read_rank_state(path(old))
                for old in sorted(needed(totals, old_world, gen.world_size, gen.rank, layouts))}
    else:
        paths = {r: p for s, r, p, _ in held if s == step}
        mine = {old: read_rank_state(paths[old]) for old, src in enumerate(sources) if src == gen.rank}
        from .restore import broadcast_state

        base = broadcast_state(gen, mine.get(0), sources[0])
        totals, layouts = base["shard_totals"], base.get("shard_layouts")
        olds = _exchange(gen, mine, sources, totals, old_world, names, layouts)
    return _assemble(base, olds, totals, old_world, gen.world_size, gen.rank, names, layouts)


def _get(store, key: str, gen) -> bytes:
    """A store read that a newer plan interrupts (a peer that died never writes ``key``)."""
    while not store.check([key]):
        if gen.interrupted():
            raise StepAborted(f"resharded restore of generation {gen.generation} abandoned: a newer plan exists")
        time.sleep(0.005)
    return store.get(key)


def _exchange(gen, mine: Mapping[int, dict], sources: Sequence[int], totals, old_world: int,
              names: Sequence[str], layouts=None) -> dict[int, dict]:
    """One all-to-all: each source sends the sharded parts of its old shards to the ranks needing them."""
    parts = {old: {n: st["objects"][n][SHARDS] for n in names} for old, st in mine.items()}
    out: dict[int, bytes] = {}
    for dst in range(gen.world_size):
        want = {old: v for old, v in parts.items()
                if dst != gen.rank and old in needed(totals, old_world, gen.world_size, dst, layouts)}
        if want:
            buf = io.BytesIO()
            torch.save(want, buf)
            out[dst] = buf.getvalue()
    send = [len(out.get(d, b"")) for d in range(gen.world_size)]
    recv = torch.zeros(gen.world_size, dtype=torch.int64)
    gen.all_to_all(recv, torch.tensor(send, dtype=torch.int64), [1] * gen.world_size, [1] * gen.world_size)
    sizes = [int(x) for x in recv.tolist()]
    blob = b"".join(out.get(d, b"") for d in range(gen.world_size))
    inp = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    data = torch.empty(sum(sizes), dtype=torch.uint8)
    gen.all_to_all(data, inp, sizes, send)
    off = 0
    for n in sizes:
        if n:
            parts.update(torch.load(io.BytesIO(data[off:off + n].numpy().tobytes()), weights_only=True))
        off += n
    return {old: {"objects": {n: {SHARDS: v[n]} for n in names}} for old, v in parts.items()}


def _assemble(base: dict[str, Any], olds: Mapping[int, dict], totals, old_world: int, world: int,
              rank: int, names: Sequence[str], layouts=None) -> dict[str, Any]:
    """The replicated base state with each sharded object's slices cut for ``rank``."""
    state = dict(base, objects=dict(base["objects"]))
    for n in names:
        shards = {}
        for k, total in totals[n].items():
            layout = layout_of(layouts, n, k)
            pieces = plan_pieces(old_lengths(layout, total, old_world), world, rank, layout)
            start, end = slice_range(layout, total, world, rank)
            like = base["objects"][n][SHARDS][k]
            t = torch.empty(end - start, dtype=like.dtype)
            for p in pieces:
                t[p.dst:p.dst + p.count] = olds[p.old_rank]["objects"][n][SHARDS][k][p.src:p.src + p.count]
            shards[k] = t
        state["objects"][n] = dict(base["objects"][n], **{SHARDS: shards})
    return state
