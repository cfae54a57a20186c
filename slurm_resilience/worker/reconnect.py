"""Process groups per generation, and collectives that a fault can interrupt.

Gloo cannot interrupt a blocked collective (abort/shutdown return while the call
waits out its timeout), so every collective here is a *bounded wait*: the work is
polled in short slices and, between slices, the store is checked for the next
generation's plan. A collective that has not completed within the group's timeout
(``reconnect.pg_timeout_s``) is abandoned the same way, whatever the backend does
with its own timeout. A broken group is parked (see ``parking.py``) instead of
destroyed, because dropping it blocks until its own timeout expires.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable, ContextManager, NamedTuple

import torch
import torch.distributed as dist

from ..errors import StepAborted
from ..model import RankTable
from ..protocol import StoreKey


__all__ = ["NODE_ADDR_ENV", "GLOO_LAZY_ENV", "choose_backend", "Generation", "Leftovers", "wait_slice", "Parked", "gloo_group", "set_gloo_interface"]


STORE_GATHER_MAX = 64
"""Up to this many ranks a gather of small rows goes through the store: each rank sets
its row and reads them all (three round trips, whatever the world), where gloo's ring
all-reduce takes 2(N-1) hops one after another (8 ranks on 2 cores: ~15 ms against
~1 ms, docs/performance.md). Beyond it the store would serve N reads of N rows."""

GATHER_PAUSE_S = (0.0005, 0.004)
"""A store gather's first and longest pause between two looks at the rows."""

NODE_ADDR_ENV = "SR_NODE_ADDR"
"""The node's own address for gloo pairs (set per node by the local cluster's TaskProlog)."""
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
"""torch's switch for gloo pairs connected on first use (``reconnect.gloo_lazy_init``)."""

log = logging.getLogger(__name__)


class Leftovers(NamedTuple):
    """The store keys a rank set in a generation's last exchanges, not yet removed: the
    next generation removes them once its first gather shows every rank has left."""

    prefix: str
    keys: tuple[str, ...]


def choose_backend(requested: str) -> str:
    """``auto`` → NCCL when CUDA is usable, gloo otherwise."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


class Generation:
    """The process group of one generation, and bounded-wait collectives on it.

    ``interrupted`` is polled between wait slices; when it returns True the
    collective is abandoned and :class:`StepAborted` raised.
    """

    def __init__(
        self,
        store: dist.Store,
        table: RankTable,
        rank: int,
        *,
        backend: str,
        timeout_s: float,
        poll_ms: float,
        interrupted: Callable[[], bool],
        channel: str = "",
        waiting: Callable[[], ContextManager] = contextlib.nullcontext,
        stale: tuple[Leftovers, ...] = (),
    ) -> None:
        """``waiting``: entered around every wait on the peers (the join, each collective),
        so the watchdog can tell a rank blocked by a peer from the one that blocks it.
        ``stale``: the previous generations' ``leftovers()``, removed after this one's
        first gather through the store (handed on again if it never makes one)."""
        self.table = table
        self.generation = table.generation
        self.rank = rank
        self.world_size = table.world_size
        self.backend = choose_backend(backend)
        self._poll = timedelta(milliseconds=poll_ms)
        self._interrupted = interrupted
        self._timeout_s = timeout_s
        self._waiting = waiting
        self._parked: list[object] = []
        # A channel is a second group of the same generation (e.g. checkpoint
        # transfers on a background thread), so it needs its own store prefix.
        self._prefix = StoreKey.PG_PREFIX.of(self.generation) + channel
        prefixed = dist.PrefixStore(self._prefix, store)
        self._rows_store = prefixed if self.world_size <= STORE_GATHER_MAX else None
        self._base, self._stale = store, stale
        self._mine: list[str] = []  # keys this rank set through the store, not removed yet
        self._gathers = 0  # gathers so far: every rank makes them in the same order
        timeout = timedelta(seconds=timeout_s)
        if self.backend == "nccl":
            self.device = torch.device("cuda", table.slots[rank].local_rank)
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = self._join(lambda: dist.ProcessGroupNCCL(prefixed, rank, self.world_size, opts))
        else:
            self.device = torch.device("cpu")
            self.pg = self._join(lambda: gloo_group(prefixed, rank, self.world_size, timeout))

    def _join(self, build: Callable[[], object]) -> object:
        """Build the group in a thread and wait in slices: a peer that dies while the
        group forms would otherwise hold every survivor in the constructor until the
        group timeout. A newer plan abandons the join (the thread is left to time out)."""
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["pg"] = build()
            except Exception as exc:  # handed to the joining thread below
                result["error"] = exc

        th = threading.Thread(target=run, name=f"sr-join-gen{self.generation}", daemon=True)
        th.start()
        with self._waiting():
            self._await_join(th)
        if "error" in result:
            raise StepAborted(f"joining generation {self.generation} failed: {_short(result['error'])}")
        return result["pg"]

    def _await_join(self, th: threading.Thread) -> None:
        while th.is_alive():
            th.join(self._poll.total_seconds())
            if th.is_alive() and self._interrupted():
                self._parked.append(th)
                raise StepAborted(f"joining generation {self.generation} abandoned: a newer plan exists")

    def interrupted(self) -> bool:
        """True when a newer generation was published: abandon what waits on this one."""
        return self._interrupted()

    # -- collectives ---------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: in-place SUM over the generation. Raises StepAborted on a fault."""
        return self._run(lambda: self.pg.allreduce([tensor]), "allreduce", tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Collective: in-place broadcast from ``root``. Raises StepAborted on a fault."""
        return self._run(lambda: self.pg.broadcast(tensor, root), "broadcast", tensor)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> torch.Tensor:
        """Collective: ``inp[in_splits[r]]`` goes to rank r, rank r's piece lands in ``out``.

        Point-to-point transfers are built on this, not on gloo send/recv: a send/recv
        wait cannot be sliced (a wait that times out closes the pair), so a transfer
        blocked on a departed peer would hold its thread for the whole group timeout.
        """
        return self._run(lambda: self.pg.alltoall_base(out, inp, out_splits, in_splits,
                                                       dist.AllToAllOptions()), "alltoall", out)

    def all_gather_ints(self, value: int) -> list[int]:
        """Collective: every rank's integer, in rank order."""
        return [row[0] for row in self.all_gather_rows([value])]

    def all_gather_rows(self, values: list[int]) -> list[list[int]]:
        """Collective: every rank's row of integers (the same length on every rank), in
        rank order: several small gathers for the price of one all-reduce, or, in a world
        of at most ``STORE_GATHER_MAX`` ranks, of three store round trips."""
        if self._rows_store is not None:
            return self._store_gather(values)
        k = len(values)
        buf = torch.zeros(self.world_size * k, dtype=torch.int64, device=self.device)
        buf[self.rank * k:(self.rank + 1) * k] = torch.tensor(values, dtype=torch.int64)
        self.all_reduce_sum(buf)
        flat = [int(v) for v in buf.cpu().tolist()]
        return [flat[r * k:(r + 1) * k] for r in range(self.world_size)]

    def _store_gather(self, values: list[int]) -> list[list[int]]:
        """Set this rank's row, wait for every rank's, read them all."""
        self._gathers += 1
        keys = [StoreKey.GATHER_ROW.of(self._gathers, r) for r in range(self.world_size)]
        raw = self._through_store(keys[self.rank], ",".join(str(int(v)) for v in values).encode(), keys, "gather")
        # Every rank set its row of this gather after reading all it needed of the
        # exchanges before it, so the keys this rank set then are read: remove them.
        done, self._mine = self._mine[:-1], self._mine[-1:]
        _drop(self._rows_store, done)
        for old in self._stale:  # and every rank of this generation has left the ones before
            _drop(dist.PrefixStore(old.prefix, self._base), old.keys)
        self._stale = ()
        return [[int(x) for x in bytes(v).decode().split(",")] for v in raw]

    @property
    def small(self) -> bool:
        """A world of at most ``STORE_GATHER_MAX`` ranks: small exchanges go through the store."""
        return self._rows_store is not None

    def store_round(self, send: bytes | None, src: int | None) -> bytes | None:
        """Collective of a small world (``small``): one point-to-point round through the
        store. A rank with receivers sets ``send`` once (the same bytes for each of them);
        a receiver gets its source ``src``'s; a rank that is neither returns at once."""
        self._gathers += 1
        mine = StoreKey.GATHER_ROW.of(self._gathers, self.rank) if send is not None else None
        keys = [] if src is None else [StoreKey.GATHER_ROW.of(self._gathers, src)]
        got = self._through_store(mine, send, keys, "transfer")
        return bytes(got[0]) if got else None

    def _through_store(self, key: str | None, value: bytes | None, keys: list[str], what: str) -> list:
        """Set ``key`` (if any), look (with a short back-off) until every one of ``keys`` is
        there, read them. A newer plan or ``pg_timeout_s`` abandons it (StepAborted), looked
        at every ``poll_interval_ms`` as a collective's wait does. (A store ``wait`` with a
        timeout would do the same, but torch logs two warnings at every expired one.)"""
        store, poll_s = self._rows_store, self._poll.total_seconds()
        deadline = time.monotonic() + self._timeout_s
        with self._waiting():
            try:
                if key is not None:
                    store.set(key, value)
                    self._mine.append(key)
                pause, look = GATHER_PAUSE_S[0], time.monotonic() + poll_s
                while keys and not store.check(keys):
                    now = time.monotonic()
                    if now >= look:
                        look = now + poll_s
                        if self._interrupted():
                            raise StepAborted(f"{what} abandoned: a new generation was published")
                        if now > deadline:
                            raise StepAborted(f"{what} did not complete within "
                                              f"reconnect.pg_timeout_s={self._timeout_s:g} s")
                    time.sleep(pause)
                    pause = min(2 * pause, GATHER_PAUSE_S[1])
                return store.multi_get(keys) if keys else []
            except dist.DistError as exc:  # the store itself failed
                raise StepAborted(f"{what} failed: {_short(exc)}") from exc

    def leftovers(self) -> tuple[Leftovers, ...]:
        """What this rank set through the store and has not removed (for the next generation)."""
        return self._stale + ((Leftovers(self._prefix, tuple(self._mine)),) if self._mine else ())

    def barrier(self) -> None:
        """Collective: returns when every rank of the generation has arrived."""
        self.all_gather_ints(1)

    def _run(self, start: Callable[[], object], what: str, tensor: torch.Tensor) -> torch.Tensor:
        with self._waiting():
            return self._wait(start, what, tensor)

    def _wait(self, start: Callable[[], object], what: str, tensor: torch.Tensor) -> torch.Tensor:
        if self._interrupted():  # a rank that comes out of its compute after the plan: no slice to wait out
            raise StepAborted(f"{what} not started: a new generation was published")
        try:
            work = start()
        except RuntimeError as exc:
            raise StepAborted(f"{what} could not start: {_short(exc)}") from exc
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                finished = wait_slice(work, self._poll)
            except RuntimeError as exc:
                self._parked.append(work)
                raise StepAborted(f"{what} failed: {_short(exc)}") from exc
            if finished:
                if tensor.is_cuda:
                    torch.cuda.current_stream().synchronize()
                return tensor
            if self._interrupted():
                self._parked.append(work)
                raise StepAborted(f"{what} abandoned: a new generation was published")
            if time.monotonic() > deadline:
                self._parked.append(work)
                raise StepAborted(f"{what} did not complete within reconnect.pg_timeout_s={self._timeout_s:g} s")

    def close(self) -> "Parked":
        """Detach: the group and its abandoned work are parked, not destroyed."""
        if self.backend == "nccl":
            try:
                self.pg.abort()  # NCCL can abort a hung communicator, gloo cannot
            except RuntimeError as exc:
                log.warning("NCCL abort failed: %s", _short(exc))
        return Parked(self.pg, self._parked, time.monotonic())


def _drop(store, keys) -> None:
    """Remove exchange keys whose readers are done; a store that fails here only leaves
    them behind (the next exchange, not this clean-up, reports a lost store)."""
    try:
        for key in keys:
            store.delete_key(key)
    except (dist.DistError, RuntimeError) as exc:
        log.debug("exchange keys left in the store: %s", _short(exc))


def wait_slice(work, slice_: timedelta) -> bool:
    """Wait at most ``slice_`` for ``work``: True when it finished, False when it is still
    running. Raises the work's own error (a RuntimeError) when the collective failed.

    torch 2.13 (gloo) gives an expired ``wait(timeout)`` no type of its own: it raises a
    plain RuntimeError ("Operation timed out!"), the same class as a failed collective
    (a dead peer: "Connection closed by peer"), and no ``DistError`` subclass. The
    work's state tells the two apart without matching text: an expired slice leaves
    it pending, a failure completes it. (NCCL raises ``DistBackendError`` on an
    expired wait; that is treated as a failure, as before.)
    """
    try:
        work.wait(slice_)
        return True
    except dist.DistError:
        raise
    except RuntimeError:
        if not work.is_completed():
            return False
        # It completed between the expired slice and the check: the result is ready,
        # and wait() returns it or raises the collective's own error.
        work.wait()
        return True


class Parked:
    """A dead generation's group kept alive until its own timeout has passed."""

    def __init__(self, pg: object, works: list[object], since: float) -> None:
        self.pg, self.works, self.since = pg, works, since


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> object:
    """A gloo group whose pairs bind the node's own address when ``SR_NODE_ADDR`` names
    one (the local cluster sets it per node, so traffic between its nodes is traffic
    between addresses); otherwise gloo's default device (``GLOO_SOCKET_IFNAME``)."""
    addr = os.environ.get(NODE_ADDR_ENV)
    if not addr:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def set_gloo_interface(ifname: str | None, lazy_init: bool = True) -> None:
    """Pin gloo to an interface (``lo`` on a one-host cluster) and choose lazy or full-mesh
    connections, before any group exists. Both are process-wide settings of torch's
    (``GLOO_SOCKET_IFNAME``, ``TORCH_GLOO_LAZY_INIT``, read when a group is built), so a
    library's own ``dist.new_group`` follows them too."""
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ[GLOO_LAZY_ENV] = "1" if lazy_init else "0"
