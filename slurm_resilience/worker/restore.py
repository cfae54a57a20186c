"""State transfer: the newest copy wins, and a survivor sends it to everyone.

Each rank offers the step of the state it can provide — survivors their live state,
fresh processes their newest node-local snapshot (or -1). The source is the lowest
rank among those offering the newest step; it broadcasts its serialized state to the
whole generation. A survivor that finished the step in flight (its all-reduce
completed before the peer died) is therefore preferred, and the others adopt its
state — the update it applied used the complete gradient sum.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Sequence

import torch


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


def serialize(state: dict[str, Any]) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def deserialize(data: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def broadcast_state(gen, state: dict[str, Any] | None, source: int) -> dict[str, Any]:
    """Collective: every rank returns the source's state (size first, then bytes)."""
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
