"""Every rank's random-number state travels in the snapshot that every node holds.

A rank's generators (torch's CPU generator, Python's ``random``, numpy's global one) are
its own: with dropout or random augmentation two ranks draw different numbers. A node's
snapshot is written by one rank of that node, so without this module the lost node's
ranks' generators would be lost with it and a spare's ranks would continue with other
streams than the fault-free run. At every snapshot the ranks all-gather their states
(a few KB each) and every node's snapshot holds all of them, by global rank; a restore
gives each rank its own entry, whichever node's snapshot it came from.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch
import torch.distributed as dist

try:
    import numpy
except ImportError:  # numpy is optional: without it there is no numpy state to keep
    numpy = None


__all__ = ["RNG_KEY", "capture", "apply", "gather", "own"]


RNG_KEY = "slurm_resilience_rng"
"""The snapshot dict's entry: one :func:`capture` per global rank."""


def capture() -> dict[str, Any]:
    """This process's generator states: ``torch`` (CPU), ``python``, ``numpy`` (when importable)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def apply(state: dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (a :func:`capture`)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if numpy is not None and "numpy" in state:
        numpy.random.set_state(state["numpy"])


def gather(state: Any, *, rank: int, world_size: int) -> list[Any]:
    """Collective: every rank's ``state``, by global rank, on every rank. A rank missing hangs."""
    if world_size == 1:
        return [state]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, state)
    return out


def own(states: Sequence[Any] | None, *, rank: int, world_size: int) -> Any | None:
    """Pure: this rank's entry of a gathered list, or None when the snapshot has none or was
    taken at another world size (then the generators are left as the program set them)."""
    if states is None or len(states) != world_size:
        return None
    return states[rank]
