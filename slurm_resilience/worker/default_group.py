"""torch.distributed's default group, re-made for every generation.

Library code (``dist.all_reduce``, ``dist.barrier``, ``DistributedDataParallel``,
``DeviceMesh``) uses the process-global default group. At every join the session
makes the generation's group the default: the old default group is taken, handed to
``dist.destroy_process_group()`` and parked (``parking.py``: dropping it could block
until its timeout), then ``dist.init_process_group`` runs again with this
generation's rank and world size.

One group, not two: the default group wraps the *same* gloo/NCCL backend object
that :class:`~slurm_resilience.worker.reconnect.Generation` built (and the toolkit's
bounded-wait collectives use). That backend is formed in ``Generation``'s join thread,
whose wait a newer plan can abandon, so a fault while joining never blocks here:
``init_process_group`` only wraps an object that already exists (measured 0.2–0.3 ms,
against 1–7 ms for a second full-mesh rendezvous of 3 ranks that would need its own
bounded wait). The hand-over goes through a registered backend (``sr_gloo``,
``sr_nccl``) whose constructor returns the prebuilt object; any other group a library
asks for with that backend (``dist.new_group``) is built as an ordinary gloo/NCCL
group on the store prefix torch gives it. ``dist.get_backend()`` therefore names
``sr_gloo``/``sr_nccl``.

Both sides issue their collectives from the training thread in the same order on
every rank, so sharing one backend keeps gloo's per-group operation order consistent.
"""

from __future__ import annotations

import logging
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from ..protocol import StoreKey
from .parking import ParkingLot
from .reconnect import gloo_group


__all__ = ["BACKENDS", "install", "release"]


log = logging.getLogger(__name__)

BACKENDS = {"gloo": "sr_gloo", "nccl": "sr_nccl"}
"""The toolkit's backend name for each real backend."""

_lock = threading.Lock()
_handoff: list[object] = []  # the prebuilt backend init_process_group is about to wrap
_registered: set[str] = set()


def _make(real: str):
    def create(store, rank: int, world_size: int, timeout: timedelta):
        with _lock:
            if _handoff:
                return _handoff.pop()
        if real == "nccl":  # a library's dist.new_group: an ordinary group of its own
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
        return gloo_group(store, rank, world_size, timeout)

    return create


def _register(real: str) -> str:
    name = BACKENDS[real]
    if name not in _registered:
        dist.Backend.register_backend(name, _make(real), devices=["cuda"] if real == "nccl" else ["cpu"])
        _registered.add(name)
    return name


def install(group, store: dist.Store, timeout_s: float, parking: ParkingLot) -> None:
    """Make ``group`` (a joined ``Generation``) torch.distributed's default group.

    ``store`` is a client of the job's store: the group's store is
    ``PrefixStore(gen{g}/default/)`` of it (nothing rendezvous there today: the backend
    exists already; it keeps anything torch writes apart per generation)."""
    release(parking)
    name = _register(group.backend)
    hook = sys.excepthook  # init_process_group wraps it again each time: keep one layer
    prefixed = dist.PrefixStore(StoreKey.PG_PREFIX.of(group.generation) + "default/", store)
    with _lock:
        _handoff[:] = [group.pg]
    try:
        dist.init_process_group(backend=name, store=prefixed, rank=group.rank,
                                world_size=group.world_size, timeout=timedelta(seconds=timeout_s))
    finally:
        with _lock:
            _handoff.clear()
    sys.excepthook = hook


def release(parking: ParkingLot) -> None:
    """Destroy the default group (if any) and park it: collectives on it fail from now on,
    and its last reference dies only after the group timeout."""
    if not dist.is_initialized():
        return
    old = dist.group.WORLD
    try:
        dist.destroy_process_group()
    finally:
        parking.park(old)
