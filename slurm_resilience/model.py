"""Value types shared by the supervisor and the worker session.

All types are frozen dataclasses: they are facts, never mutated. A new rank
table is a new object with a higher generation.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from slurm_resilience.errors import RankTableError

__all__ = ["FaultKind", "Fault", "RankSlot", "RankTable", "RANK_TABLE_VERSION"]

RANK_TABLE_VERSION = 1


class FaultKind(enum.Enum):
    """What went wrong, as far as the supervisor can tell."""

    NODE_LOST = "node_lost"
    """The node cannot be reached at all (slurmd unreachable): its ranks are gone."""

    PROCESS_DIED = "process_died"
    """The rank's process exited (connection closed, step ended) on a reachable node."""

    PROCESS_HUNG = "process_hung"
    """The rank's heartbeat is stale but its process has not exited and the node is up."""

    NODE_UNHEALTHY = "node_unhealthy"
    """Slurm marks the node down, drained, failing or not responding."""

    NODE_PARTITIONED = "node_partitioned"
    """The node is cut from its peers while the supervisor and Slurm still reach it
    (its peers' probes fail both ways: ``supervisor/observe/partition.py``)."""


@dataclass(frozen=True)
class Fault:
    """One detected fault: which rank (if known) on which node, when and why."""

    kind: FaultKind
    rank: int | None
    node: str
    time: float
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict (``kind`` as its string value)."""
        return {
            "kind": self.kind.value,
            "rank": self.rank,
            "node": self.node,
            "time": self.time,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: node, worker process id, device and address."""

    rank: int
    node: str
    worker_id: str
    local_rank: int = 0
    device: str = "cpu"
    address: str = "127.0.0.1"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "worker_id": self.worker_id,
            "local_rank": self.local_rank,
            "device": self.device,
            "address": self.address,
        }


_SLOT_FIELDS = {"rank": int, "node": str, "worker_id": str, "local_rank": int, "device": str, "address": str}
_SLOT_REQUIRED = ("rank", "node", "worker_id")


@dataclass(frozen=True)
class RankTable:
    """Rank → slot assignment for one generation; slot i has rank i.

    Invariants (checked on construction, ``RankTableError`` otherwise):
    generation >= 0, ranks are 0..n-1 in order; a node's slots are consecutive with
    local ranks 0..G-1, and every node holds the same G (``tasks_per_node``). So the
    global rank is ``node index × G + local rank``::

        node:        n2          n3          n4
        local rank:  0   1       0   1       0   1
        rank:        0   1       2   3       4   5
    """

    generation: int
    slots: tuple[RankSlot, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.generation, int) or isinstance(self.generation, bool) or self.generation < 0:
            raise RankTableError(f"rank table generation must be an int >= 0, got {self.generation!r}")
        if not isinstance(self.slots, tuple):
            object.__setattr__(self, "slots", tuple(self.slots))
        by_node: dict[str, list[int]] = {}
        for i, slot in enumerate(self.slots):
            if not isinstance(slot, RankSlot):
                raise RankTableError(f"rank table slot {i} is not a RankSlot: {slot!r}")
            if slot.rank != i:
                raise RankTableError(f"rank table slot {i} has rank {slot.rank}: ranks must be 0..n-1 in order")
            ranks = by_node.setdefault(slot.node, [])
            if ranks and ranks[-1] != i - 1:
                raise RankTableError(f"node {slot.node!r} is used by ranks {ranks[0]} and {i}, not consecutive")
            if slot.local_rank != len(ranks):
                raise RankTableError(f"rank {i} on {slot.node!r} has local rank {slot.local_rank}, "
                                     f"expected {len(ranks)}")
            ranks.append(i)
        sizes = {len(r) for r in by_node.values()}
        if len(sizes) > 1:
            raise RankTableError(f"nodes hold different numbers of ranks ({sorted(sizes)}): "
                                 "every node must hold tasks_per_node ranks")
        object.__setattr__(self, "_by_node", {n: tuple(r) for n, r in by_node.items()})  # O(1) at 16k ranks

    @property
    def world_size(self) -> int:
        return len(self.slots)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The node of each rank, in rank order (a node repeats G times)."""
        return tuple(s.node for s in self.slots)

    @property
    def node_list(self) -> tuple[str, ...]:
        """Each node once, in node-index order (``GROUP_RANK``)."""
        return tuple(self._by_node)

    @property
    def tasks_per_node(self) -> int:
        """G: ranks per node (0 for an empty table)."""
        return len(next(iter(self._by_node.values()))) if self._by_node else 0

    def ranks_on(self, node: str) -> tuple[int, ...]:
        """The ranks ``node`` holds (empty if none)."""
        return self._by_node.get(node, ())

    def group_rank(self, rank: int) -> int:
        """The node index of ``rank`` (torchrun's ``GROUP_RANK``)."""
        return rank // self.tasks_per_node

    def slot_for_node(self, node: str) -> RankSlot | None:
        """The first slot (local rank 0) on ``node``, or None if the node holds no rank."""
        ranks = self._by_node.get(node)
        return self.slots[ranks[0]] if ranks else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RANK_TABLE_VERSION,
            "generation": self.generation,
            "world_size": self.world_size,
            "ranks": [s.to_dict() for s in self.slots],
        }

    def to_json(self, *, compact: bool = False) -> str:
        """Stable JSON text (sorted keys, the ranks last); a rank per line for people, ``compact`` for the wire.

        The people's form is one flat ``json.dumps`` (the C encoder) with a line break put
        between ranks: ``indent=`` runs the pure-Python encoder, 65 ms at 16,384 ranks."""
        d = self.to_dict()
        if compact:
            return json.dumps(d, sort_keys=True, separators=(",", ":"))
        flat = json.dumps(d["ranks"], sort_keys=True)[1:-1]
        if flat.count("}, {") != max(0, len(self.slots) - 1):  # a field that holds "}, {" itself
            return json.dumps(d, sort_keys=True, indent=2) + "\n"
        ranks = flat.replace("}, {", "},\n    {")
        head = json.dumps({k: v for k, v in d.items() if k != "ranks"}, sort_keys=True, indent=2)[:-2]
        return f'{head},\n  "ranks": [\n    {ranks}\n  ]\n}}\n' if ranks else f'{head},\n  "ranks": []\n}}\n'

    @classmethod
    def from_json(cls, text: str) -> "RankTable":
        """Parse ``to_json`` output. Raises RankTableError with a one-line message."""
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise RankTableError(f"rank table is not valid JSON: {exc}") from None
        return cls.from_dict(doc)

    def to_wire(self) -> dict[str, Any]:
        """The compact form the plan carries (``protocol.Plan``), every rank reads it: the
        invariants make rank and local rank implicit, so it holds G, each node once (with
        its address), and per rank only the worker id — as its number when the id is
        ``{node}.{n}`` on its own node (the supervisor's ids, ``state.new_id``) — and the
        device when it is not the default for its local rank. About 6 bytes per rank
        instead of ~115 (1.9 MB → ~0.1 MB at 16,384 ranks)."""
        g = self.tasks_per_node
        nodes = list(self._by_node)
        workers: list[Any] = []
        for s in self.slots:
            head, _, tail = s.worker_id.rpartition(".")
            workers.append(int(tail) if head == s.node and tail.isdigit() and str(int(tail)) == tail else s.worker_id)
        base = self.slots[0].device.split(":")[0] if self.slots else "cpu"
        devices = [s.device for s in self.slots]
        plain = all(d == (f"{base}:{s.local_rank}" if base == "cuda" else base) for d, s in zip(devices, self.slots))
        return {"version": RANK_TABLE_VERSION, "generation": self.generation, "g": g, "nodes": nodes,
                "addresses": [self.slots[self._by_node[n][0]].address for n in nodes], "workers": workers,
                "device": base, "devices": None if plain else devices}

    @classmethod
    def from_wire(cls, doc: Any) -> "RankTable":
        """Inverse of :meth:`to_wire`. Raises RankTableError with a one-line message."""
        try:
            if doc.get("version") != RANK_TABLE_VERSION:
                raise RankTableError(f"unsupported rank table version {doc.get('version')!r}")
            g, nodes, addresses, workers = int(doc["g"]), list(doc["nodes"]), list(doc["addresses"]), list(doc["workers"])
            base, devices = str(doc["device"]), doc.get("devices")
            if len(addresses) != len(nodes) or len(workers) != g * len(nodes) or (devices and len(devices) != len(workers)):
                raise RankTableError("rank table: nodes, addresses, workers and devices do not match in length")
            slots = []
            for i, w in enumerate(workers):
                node, local = str(nodes[i // g]), i % g
                device = str(devices[i]) if devices else (f"cuda:{local}" if base == "cuda" else base)
                wid = f"{node}.{w}" if isinstance(w, int) and not isinstance(w, bool) else str(w)
                slots.append(RankSlot(rank=i, node=node, worker_id=wid, local_rank=local, device=device,
                                      address=str(addresses[i // g])))
            return cls(generation=int(doc["generation"]), slots=tuple(slots))
        except RankTableError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise RankTableError(f"malformed rank table on the wire: {exc}") from None

    @classmethod
    def from_dict(cls, doc: Any) -> "RankTable":
        """Inverse of ``to_dict``. Raises RankTableError with a one-line message."""
        if not isinstance(doc, dict):
            raise RankTableError("rank table JSON must be an object")
        if doc.get("version") != RANK_TABLE_VERSION:
            raise RankTableError(f"unsupported rank table version {doc.get('version')!r}, expected {RANK_TABLE_VERSION}")
        ranks = doc.get("ranks")
        if not isinstance(ranks, list):
            raise RankTableError("rank table JSON needs a 'ranks' list")
        gen = doc.get("generation")
        if not isinstance(gen, int) or isinstance(gen, bool):
            raise RankTableError(f"rank table 'generation' must be an int, got {gen!r}")
        slots = tuple(_slot_from_dict(i, r) for i, r in enumerate(ranks))
        table = cls(generation=gen, slots=slots)
        if doc.get("world_size") != table.world_size:
            raise RankTableError(f"rank table 'world_size' is {doc.get('world_size')!r} but it lists {table.world_size} ranks")
        return table


def _slot_from_dict(i: int, raw: Any) -> RankSlot:
    if not isinstance(raw, dict):
        raise RankTableError(f"rank table entry {i} must be an object")
    unknown = set(raw) - set(_SLOT_FIELDS)
    if unknown:
        raise RankTableError(f"rank table entry {i} has unknown keys: {', '.join(sorted(unknown))}")
    for key in _SLOT_REQUIRED:
        if key not in raw:
            raise RankTableError(f"rank table entry {i} is missing '{key}'")
    for key, typ in _SLOT_FIELDS.items():
        if key in raw and (not isinstance(raw[key], typ) or isinstance(raw[key], bool)):
            raise RankTableError(f"rank table entry {i}: '{key}' must be {typ.__name__}, got {raw[key]!r}")
    return RankSlot(**raw)
