"""State transfer: the newest copy wins, and the ranks holding it stream it to the rest.

Each rank offers the step of the state it can provide — survivors their live state,
fresh processes their newest node-local snapshot (or -1). The newest step wins
(:func:`choose_source`: a survivor that finished the step in flight, its all-reduce
completed before the peer died, is preferred and the others adopt its state — the
update it applied used the complete gradient sum). Ranks offering that step keep
(or load) their own copy; every other rank receives one from a source that
:func:`assign_sources` picks round-robin among them, so the ranks of a replaced node
restore from different survivors in parallel.

The transfer (:func:`stream_state`) moves only what is needed, through bounded
memory: the source flattens its state (``checkpoint/state_tree.py``) into a small
skeleton (everything that is not a dense tensor) and its tensors, sends the skeleton
with an index of the tensors (name, dtype, shape) and the first chunk of the tensors'
bytes, then the rest in chunks of ``chunk_bytes`` (:func:`chunk_plan`) through one
send and one receive buffer; what each rank must know of the sources first (header
length, rounds, first chunk) comes with the offers' gather (:func:`outgoing`), so a
state under ``chunk_bytes`` moves in one all-to-all — or, in a small world
(``reconnect.STORE_GATHER_MAX`` ranks) and under ``STORE_BYTES``, through the store:
each source sets its bytes once, each receiver gets its source's, the other ranks go
on at once (``Generation.store_round``). A receiver writes each chunk
straight into its destination tensors: its own
tensors of the same name, dtype and shape when it has them (a survivor or warm
standby receives in place), else freshly allocated ones — the state itself, not a
copy. Each chunk round is one bounded-wait all-to-all of the generation
(``reconnect.py``), so a newer plan or a departed peer aborts it (StepAborted).

``broadcast_state`` (the whole state serialized and broadcast as one byte tensor)
remains for the resharded restore's small base state (``reshard.py``).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from typing import Any, Mapping, Sequence

import torch

from ..checkpoint.state_tree import flatten_state, unflatten_state


__all__ = [
    "CHUNK_BYTES", "STORE_BYTES", "RestorePlan", "choose_source", "assign_sources", "TensorSpec", "Piece", "chunk_plan",
    "chunk_length", "Outgoing", "outgoing", "stream_state", "serialize", "deserialize", "broadcast_state"
]


CHUNK_BYTES = 16 << 20  # bytes per chunk round: the size of the send and the receive buffer
STORE_BYTES = 1 << 20  # a state in one round of at most this much goes through the store in a small world


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Pure result of :func:`choose_source`."""

    source_rank: int
    step: int


def choose_source(offers: Sequence[int]) -> RestorePlan:
    """Lowest rank among those offering the newest step. Raises if nobody offers."""
    if not offers:
        raise ValueError("no rank in the generation")
    best = max(offers)
    if best < 0:
        raise ValueError("no rank holds any state (no survivor, no snapshot)")
    return RestorePlan(source_rank=offers.index(best), step=best)


def assign_sources(offers: Sequence[int]) -> dict[int, int]:
    """Receiver rank → source rank: every rank offering less than the newest step gets
    one of the ranks offering it, round-robin in rank order (deterministic, so every
    rank computes the same map). Ranks at the newest step are not in the map.
    Raises ValueError as :func:`choose_source`."""
    best = choose_source(offers).step
    sources = [r for r, o in enumerate(offers) if o == best]
    receivers = [r for r, o in enumerate(offers) if o < best]
    return {r: sources[i % len(sources)] for i, r in enumerate(receivers)}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the index a source sends before the bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_gpu: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + length)`` of tensor ``tensor`` travel at ``at`` in the chunk."""

    tensor: int
    start: int
    length: int
    at: int


def chunk_plan(sizes: Sequence[int], chunk_bytes: int) -> list[list[Piece]]:
    """Pack the tensors' bytes (``sizes``, in index order) back to back into chunks of
    ``chunk_bytes`` (the last one shorter); a tensor may span chunks, empty tensors
    appear in none. Raises ValueError for a chunk size below 1 or a negative size."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    chunks: list[list[Piece]] = []
    fill = chunk_bytes  # the current chunk is full: the next piece opens a new one
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"tensor {i} has negative size {size}")
        start = 0
        while start < size:
            if fill == chunk_bytes:
                chunks.append([])
                fill = 0
            n = min(size - start, chunk_bytes - fill)
            chunks[-1].append(Piece(tensor=i, start=start, length=n, at=fill))
            start += n
            fill += n
    return chunks


def chunk_length(chunk: Sequence[Piece]) -> int:
    """Bytes of one chunk: where its last piece ends (0 for an empty chunk)."""
    return chunk[-1].at + chunk[-1].length if chunk else 0


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """What a source sends: its tensors, their index, the chunk plan and the pickled
    header (skeleton + index). ``meta`` (header length, chunk rounds, first chunk's
    length) is what every rank must know of each source before the transfer."""

    tensors: list[torch.Tensor]
    plan: list
    header: bytes

    @property
    def meta(self) -> list[int]:
        return [len(self.header), len(self.plan), chunk_length(self.plan[0]) if self.plan else 0]


def outgoing(state: dict[str, Any], chunk_bytes: int = CHUNK_BYTES) -> Outgoing:
    """A source's side of :func:`stream_state`, prepared from ``state`` (which must not
    change before it is sent): prepared ahead, its ``meta`` can travel with the offers."""
    flat, skeleton = flatten_state(state)
    index = [TensorSpec(n, t.dtype, tuple(t.shape), t.is_cuda) for n, t in flat.items()]
    return Outgoing(list(flat.values()), chunk_plan([s.nbytes for s in index], chunk_bytes),
                    pickle.dumps((skeleton, index), protocol=pickle.HIGHEST_PROTOCOL))


def stream_state(gen, sources: Mapping[int, int], state: dict[str, Any] | None, *,
                 into: Mapping[str, torch.Tensor] | None = None, chunk_bytes: int = CHUNK_BYTES,
                 ready: Outgoing | None = None, metas: Sequence[Sequence[int]] | None = None
                 ) -> dict[str, Any] | None:
    """Collective: every receiver in ``sources`` (receiver → source rank, from
    :func:`assign_sources`) gets its source's ``state``; sources pass their state,
    receivers ``None``, other ranks take part with whatever they hold. Returns the
    received state on a receiver, ``state`` elsewhere. With no receiver at all it
    returns at once, without a collective.

    ``into``: this receiver's own tensors by flattened name (``flatten_state``); a
    contiguous one of the same dtype and shape receives in place, so its old values
    are lost even when the transfer aborts. Tensors arrive contiguous (values, dtype
    and shape exact; a non-contiguous source tensor's strides are not kept).
    ``ready``: this rank's :func:`outgoing` of ``state``, prepared ahead; ``metas``: every
    rank's ``Outgoing.meta`` ([-1, -1, -1] where it has none), gathered ahead with the offers:
    when every source's is there, the transfer starts without a collective of its own.
    Raises StepAborted when a peer leaves or a newer plan appears meanwhile (every
    rank recovers again), CheckpointError when the source's skeleton cannot be pickled.
    """
    if not sources:
        return state
    me = gen.rank
    mine = sorted(r for r, s in sources.items() if s == me)  # my receivers, in rank order
    src = sources.get(me)
    out = (ready or outgoing(state, chunk_bytes)) if mine else Outgoing([], [], b"")
    header, tensors, plan = out.header, out.tensors, out.plan
    senders = set(sources.values())
    if metas is None or any(metas[s][0] < 0 for s in senders):
        metas = gen.all_gather_rows(out.meta)  # one collective for all three
    rounds = max(metas[s][1] for s in senders)
    # Round 0: the header and the first chunk together (a state under chunk_bytes: one round).
    h, n0 = len(header), out.meta[2]
    recv0 = metas[src][0] + metas[src][2] if src is not None else 0
    # A small world's one-round transfer goes through the store: one copy for every receiver.
    via_store = rounds == 1 and gen.small and max(metas[s][0] + metas[s][2] for s in senders) <= STORE_BYTES
    copies = min(len(mine), 1) if via_store else len(mine)
    first = torch.empty(max((h + n0) * copies, recv0), dtype=torch.uint8, device=gen.device)
    views = _ByteViews(tensors)
    if mine:
        first[:h].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if n0:
            views.pack(plan[0], first[h:h + n0], n0, 1)
        for i in range(1, copies):
            first[i * (h + n0):(i + 1) * (h + n0)].copy_(first[:h + n0])
    if via_store:
        raw = gen.store_round(first[:h + n0].cpu().numpy().tobytes() if mine else None, src)
        got = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(gen.device) if raw is not None else first[:0]
    else:
        got = _round(gen, mine, src, h + n0, recv0, first)
    if src is not None:  # a receiver: the index tells what to allocate (or adopt) and the plan
        hl = metas[src][0]
        skeleton, index = pickle.loads(got[:hl].cpu().numpy().tobytes())
        tensors = _destinations(index, into or {}, gen.device)
        plan = chunk_plan([s.nbytes for s in index], chunk_bytes)
        views = _ByteViews(tensors)
        if plan:
            views.unpack(plan[0], got[hl:])
    del first, got
    buf = torch.empty(chunk_bytes * max(len(mine), 1) if rounds > 1 else 0, dtype=torch.uint8, device=gen.device)
    for k in range(1, rounds):
        chunk = plan[k] if k < len(plan) else []
        n = chunk_length(chunk)
        if mine:
            views.pack(chunk, buf, n, len(mine))
        got = _round(gen, mine, src, n, n, buf)
        if src is not None:
            views.unpack(chunk, got)
    if src is None:
        return state
    return unflatten_state({s.name: t for s, t in zip(index, tensors)}, skeleton)


def _round(gen, mine: Sequence[int], src: int | None, n_send: int, n_recv: int,
           buf: torch.Tensor) -> torch.Tensor:
    """Collective: one all-to-all; ``buf`` holds ``n_send`` bytes per receiver of mine (in
    rank order) and, on a receiver, takes the ``n_recv`` bytes from ``src``."""
    w = gen.world_size
    in_splits, out_splits = [0] * w, [0] * w
    for r in mine:
        in_splits[r] = n_send
    if src is not None:
        out_splits[src] = n_recv
    empty = buf[:0]
    inp = buf[: n_send * len(mine)] if mine else empty
    out = buf[:n_recv] if src is not None else empty
    gen.all_to_all(out, inp, out_splits, in_splits)
    return out


def _destinations(index: Sequence[TensorSpec], into: Mapping[str, torch.Tensor],
                  device: torch.device) -> list[torch.Tensor]:
    """A tensor per index entry: this rank's own one where it fits (receive in place),
    else a new one (on the GPU when the source's was and this rank has one)."""
    out, taken = [], set()
    for spec in index:
        t = into.get(spec.name)
        if (t is not None and t.dtype == spec.dtype and tuple(t.shape) == spec.shape
                and t.layout == torch.strided and t.is_contiguous() and t.numel() > 0
                and t.data_ptr() not in taken):  # tied weights: one destination each
            taken.add(t.data_ptr())
            out.append(t)
            continue
        where = torch.device("cpu")
        if spec.on_gpu and torch.cuda.is_available():
            where = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        out.append(torch.empty(spec.shape, dtype=spec.dtype, device=where))
    return out


class _ByteViews:
    """Each tensor as flat bytes; a non-contiguous one through a contiguous copy, the
    latest only (a tensor's chunks come one after another)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = tensors
        self._copy: tuple[int, torch.Tensor] | None = None

    def __call__(self, i: int) -> torch.Tensor:
        t = self._tensors[i]
        if t.is_contiguous():
            return t.reshape(-1).view(torch.uint8)
        if self._copy is None or self._copy[0] != i:
            self._copy = (i, t.contiguous().reshape(-1).view(torch.uint8))
        return self._copy[1]

    def pack(self, chunk: Sequence[Piece], buf: torch.Tensor, n: int, copies: int) -> None:
        for p in chunk:
            buf[p.at:p.at + p.length].copy_(self(p.tensor)[p.start:p.start + p.length])
        for i in range(1, copies):
            buf[i * n:(i + 1) * n].copy_(buf[:n])

    def unpack(self, chunk: Sequence[Piece], got: torch.Tensor) -> None:
        for p in chunk:
            self(p.tensor)[p.start:p.start + p.length].copy_(got[p.at:p.at + p.length])


def serialize(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as one uint8 tensor of its ``torch.save`` bytes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def deserialize(data: torch.Tensor) -> dict[str, Any]:
    """The state a :func:`serialize` tensor holds (on any device)."""
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def broadcast_state(gen, state: dict[str, Any] | None, source: int) -> dict[str, Any]:
    """Collective: every rank returns the source's state (size first, then bytes): the
    whole state serialized at once. Used for small states (``reshard.py``'s base)."""
    payload = serialize(state) if gen.rank == source else None
    size = _to(torch.tensor([payload.numel() if payload is not None else 0]), gen.device)
    gen.broadcast(size, source)
    n = int(size.item())
    data = payload if payload is not None else torch.empty(n, dtype=torch.uint8)
    data = _to(data, gen.device)
    gen.broadcast(data, source)
    return state if gen.rank == source else deserialize(data)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)
