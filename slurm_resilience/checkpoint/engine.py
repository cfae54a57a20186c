"""The per-rank checkpoint engine: a blocking host copy, the rest in the background.

    save(step, state)                      training thread, at a safe point
      └─ L0: copy tensors device→host into reused buffers (pinned with CUDA)   ← the only stall
    writer thread, checkpoints in step order (identical order on every rank):
      ├─ L1: HDF5 shard on the node-local disk (atomic, checksummed)
      │     PARTNER: shard bytes → partner rank over the transfer group; its copy → our disk
      │     XOR: parity row of our group, exchanged over the transfer group → our disk
      ├─ vote: every rank reports durable/failed (collective on the transfer group)
      │     all durable → manifest, then ``latest`` (never before)
      └─ L2: every K-th: rank 0 creates the step directory (on Lustre: ``lfs setstripe``),
            deduplicated (``dedup``): each replicated tensor written by one rank only,
            every rank's sharded/per-rank tensors by itself; vote, rank 0 commits

A failing checkpoint (disk full, I/O error, a lost peer) is an event, never raised; older steps stay.

Restore: :meth:`CheckpointEngine.rebuild_missing` (collective) first rebuilds XOR
shards lost with a node into the rank that now holds the slot; then every rank
walks ``candidates()`` fastest-first, verifying checksums (``best``), and reads
through ``shared_read`` (a dedup L2 step: its own file + owners' files). Another
run's steps are not candidates (``ownership``), ended runs' directories go (``clean``).

What the writer does per tier is in ``persist``; every path comes from ``layout``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import CheckpointError
from . import clean, layout
from . import manifest as mf
from .hdf5_format import verify_shard
from .intervals import IntervalEstimator
from ..run_identity import RunIdentity
from .lustre import LustreStriping, Striping
from .ownership import Ownership
from .state_tree import copies, flatten_state, unflatten_state
from .shared_read import read_rank_state, verify_rank_problems
from .persist import Job, Lazy, first_line, persist_local, persist_shared, prune_local
from .tiers import Redundancy, TierSpec, base_tier, tier_for_step
from .xor_rebuild import rebuild_tier

__all__ = ["CheckpointEngine"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _BufferSet:
    tensors: dict[str, torch.Tensor]
    skeleton: bytes = b""
    step: int = -1
    busy: bool = False


@dataclasses.dataclass
class _Rebuild:
    transfer: Any
    rank: int
    nodes: tuple[str, ...]
    owners: dict[str, tuple[int, ...]]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: list[tuple[int, int, bool]] = dataclasses.field(default_factory=list)


class CheckpointEngine:
    """Multi-level checkpoints of one rank. Not thread-safe: one caller (the training loop).

    ``striping`` is the filesystem adapter for shared tiers (default: the mount table
    and ``lfs``, :class:`~.lustre.LustreStriping`); tests inject a fake.
    """

    def __init__(self, specs: Sequence[TierSpec], *, job_id: str, run_id: str, job_dir: str, node: str,
                 emit: Callable[..., None] = lambda kind, **f: None, mtbf_s: float = 86400.0,
                 striping: Striping | None = None, adopt_legacy: bool = False) -> None:
        self.specs = tuple(specs)
        self._by_storage = {s.storage: s for s in reversed(self.specs)}
        self.job_id, self.run_id, self.job_dir, self.node, self._emit = job_id, run_id, job_dir, node, emit
        self.ownership = Ownership(RunIdentity(job_id, run_id), adopt_legacy=adopt_legacy, emit=emit)
        self._cleaner: threading.Thread | bool | None = False  # clean.py, at the first bind
        self._pinned, self._sets = torch.cuda.is_available(), [_BufferSet({}), _BufferSet({})]
        self._l0: _BufferSet | None = None
        self._lock = threading.Condition()
        self._queue: "queue.Queue[Job | _Rebuild | None]" = queue.Queue()
        self._last: dict[str, tuple[int, float]] = {}
        self._counts: dict[str, int] = {}
        self.estimator = IntervalEstimator(mtbf_s=mtbf_s) if any(s.auto for s in self.specs) else None
        self.rank, self.world_size, self.nodes, self._transfer = 0, 1, (node,), None
        self._owners = self._root_owners()
        self.stats: list[dict[str, float]] = []
        self.failures: list[tuple[int, str]] = []  # (step, why) of checkpoints not committed
        self.dedup_shared = True  # shared tiers: each replicated tensor once per step (dedup.py)
        self._verified: dict[str, tuple[int, int, int]] = {}  # path -> stat key of a verified shard
        self._striping = striping if striping is not None else LustreStriping()
        self._on_lustre: dict[str, bool] = {}  # tier root -> detected once (writer thread)
        self._thread = threading.Thread(target=self._writer, name="sr-ckpt-writer", daemon=True)
        self._thread.start()

    # -- membership ------------------------------------------------------------
    def bind(self, *, rank: int, world_size: int, nodes: Sequence[str],
             transfer: Callable[[], Any] | None, park: Callable[[object], None] | None = None) -> None:
        """A new generation: rank, world, and a factory for the writer's transfer group.

        The group is built lazily by the writer thread at the generation's first
        checkpoint (every rank reaches it at the same step), so rebuilding it is
        off the recovery's critical path. The old one is parked (``park``): dropping it
        would hold the writer until a cut-off exchange's gloo timeout."""
        if park is not None and self._transfer is not None:
            park(self._transfer)
        self.rank, self.world_size, self.nodes = rank, world_size, tuple(nodes)
        self._owners = self._root_owners()
        self._transfer = Lazy(transfer) if transfer is not None else None
        if self._cleaner is False:  # the roots' owners are known now: each cleans its own once
            self._cleaner = clean.clean_in_background(
                [(s.name, s.path) for s in self._spoken_specs()],
                dict(job_id=self.job_id, node=self.node, rank=self.rank, job_dir=self.job_dir,
                     user=layout.current_user()), self.run_id, self._emit)

    def _spoken_specs(self) -> list[TierSpec]:
        """Disk tiers whose root this rank speaks for: a local root's owner, rank 0 for shared."""
        return [s for s in self.specs if (s.storage == "local" and self._owners[s.name][self.rank] == self.rank)
                or (s.storage == "shared" and self.rank == 0)]

    def report_foreign(self) -> None:
        """A restore is over: one event for the other runs' steps skipped (``ownership.report``)."""
        roots = {self.root(s) for s in self._spoken_specs()}
        self.ownership.report(roots | {layout.partner_root(r) for r in roots})

    def _root_owners(self) -> dict[str, tuple[int, ...]]:
        """Node-local tier -> the rank owning each rank's root (the G ranks of a node share one)."""
        return {s.name: layout.root_owners(s, self.nodes, job_id=self.job_id, run_id=self.run_id,
                                           job_dir=self.job_dir)
                for s in self.specs if s.storage == "local"}

    @property
    def needs_agreement(self) -> bool:
        """Time/auto intervals differ per rank: the caller must agree on ``due`` collectively."""
        return any(s.interval_s is not None or s.auto for s in self.specs)

    def root(self, spec: TierSpec, rank: int | None = None) -> str:
        """The tier root of ``spec`` for this job, node and ``rank`` (default: ours)."""
        return layout.expand_path(spec, job_id=self.job_id, run_id=self.run_id, node=self.node,
                                  rank=self.rank if rank is None else rank, job_dir=self.job_dir)

    # -- save --------------------------------------------------------------------
    def due(self, step: int) -> list[str]:
        """The tiers that checkpoint at ``step``, in ``specs`` order (``tiers.tier_for_step``)."""
        autos = ({s.name: self.estimator.interval_steps() for s in self.specs if s.auto}
                 if self.estimator is not None else {})
        return tier_for_step(self.specs, step, now=time.time(), last_saved=self._last,
                             auto_interval_steps=autos, save_counts=self._base_counts(step))

    def _base_counts(self, step: int) -> dict[str, int]:
        """Base-tier checkpoints before ``step``, derived from the step itself when the
        base interval is in steps: a replacement rank (fresh counters) must make the
        same every_kth decision as the survivors, or the writers' collectives diverge."""
        base = base_tier(self.specs)
        if base is not None and base.interval_steps:
            return {base.name: step // base.interval_steps - 1}
        return dict(self._counts)

    def save(self, step: int, state: Any, tiers: Sequence[str] | None = None) -> float:
        """Copy ``state`` to host memory (blocking) and queue the disk tiers. Returns the stall (s)."""
        tiers = list(self.due(step) if tiers is None else tiers)
        if not tiers:
            return 0.0
        t0 = time.perf_counter()
        tensors, skeleton = flatten_state(state)
        buf = self._acquire()
        for key, t in tensors.items():
            dst = buf.tensors.get(key)
            if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pinned)
                buf.tensors[key] = dst
            dst.copy_(t.detach(), non_blocking=self._pinned)
        for key in set(buf.tensors) - set(tensors):
            del buf.tensors[key]
        if self._pinned:
            torch.cuda.synchronize()
        buf.skeleton, buf.step = skeleton, step
        stall = time.perf_counter() - t0
        with self._lock:
            self._l0 = buf
        now = time.time()
        for name in tiers:
            self._last[name] = (step, now)
            self._counts[name] = self._counts.get(name, 0) + 1
        disk = [n for n in tiers if self._spec(n).storage != "memory"]
        if disk:
            buf.busy = True
            self._queue.put(Job(step, disk, buf, self._transfer, self.rank, self.world_size, self.nodes,
                                self._owners, self.ownership))
        if self.estimator is not None:
            self.estimator.observe_checkpoint(stall)
        self._emit("checkpoint_saved", step=step, tiers=tiers, stall_ms=round(stall * 1000, 3))
        return stall

    def _spec(self, name: str) -> TierSpec:
        return next(s for s in self.specs if s.name == name)

    def _acquire(self) -> _BufferSet:
        """A buffer set neither in L0 nor being persisted; waits for the writer if needed."""
        with self._lock:
            while True:
                for b in self._sets:
                    if b is not self._l0 and not b.busy:
                        return b
                if self._l0 is not None and not self._l0.busy:
                    return self._l0  # the previous L0 copy is superseded by this one
                self._lock.wait()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the writer has drained the queue (tests, end of training)."""
        deadline = None if timeout is None else time.time() + timeout
        with self._lock:
            while any(b.busy for b in self._sets):
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # -- writer thread -----------------------------------------------------------
    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Rebuild):
                self._rebuild(job)
                continue
            try:
                self._persist(job)
            except Exception as exc:  # reported, never raised into training
                log.warning("checkpoint of step %d failed: %s", job.step, exc)
                self.failures.append((job.step, first_line(exc)))
                self._emit("checkpoint_failed", step=job.step, tiers=job.tiers, error=first_line(exc))
            finally:
                with self._lock:
                    job.buffers.busy = False
                    self._lock.notify_all()

    def _persist(self, job: Job) -> None:
        state = unflatten_state(job.buffers.tensors, job.buffers.skeleton)
        attrs = {"step": job.step, "rank": job.rank, "world_size": job.world_size}
        local_path = None
        for name in job.tiers:
            spec = self._spec(name)
            t0 = time.perf_counter()
            root = self.root(spec, job.rank)
            if spec.storage == "local":
                local_path, nbytes = persist_local(spec, root, job, state, attrs)
            else:
                nbytes = persist_shared(spec, root, job, state, attrs, local_path,
                                        stripe_new_dir=self._stripe_new_dir, dedup=self.dedup_shared)
            dt = time.perf_counter() - t0  # until committed (latest moved); pruning is after
            self.stats.append({"tier": name, "step": job.step, "seconds": dt, "bytes": nbytes})
            self._emit("checkpoint_durable", step=job.step, tier=name, seconds=round(dt, 4),
                       bytes=nbytes)
            if spec.storage == "local":
                prune_local(spec, root, job)  # the root's owner only: node-mates never race

    def _stripe_new_dir(self, spec: TierSpec, directory: str) -> None:
        """Writer thread, rank 0: stripe a new step directory of a shared tier on Lustre.

        Detection runs once per tier root; a failure is a warning and a
        ``checkpoint_stripe_failed`` event (the files get the default layout)."""
        root = os.path.dirname(directory)
        if root not in self._on_lustre:
            self._on_lustre[root] = self._striping.is_lustre(root)
        if not self._on_lustre[root] or spec.stripe_count == 0:
            return
        try:
            self._striping.stripe(directory, spec.stripe_count, spec.stripe_size)
        except CheckpointError as exc:
            log.warning("striping %s failed: %s", directory, exc)
            self._emit("checkpoint_stripe_failed", tier=spec.name, path=directory, error=first_line(exc))

    # -- restore -------------------------------------------------------------------
    def rebuild_missing(self) -> list[tuple[int, int, bool]]:
        """Collective (transfer group): rebuild XOR-protected L1 shards lost with a node.

        Every rank of the generation calls it at the same point of a restore, before
        ``best()``; it runs on the writer thread after the checkpoints already queued
        (so every rank's transfer-group collectives stay in the same order). Per XOR
        tier, the newest step every group can complete is rebuilt into the ranks
        lacking it (bit-identical, checksums verified), with their parity rows,
        manifest and ``latest``. Returns [(step, rank, rebuilt)], the same on every
        rank. Never raises: a missing rank or a failed collective is reported as a
        ``checkpoint_rebuild_failed`` event and nothing is rebuilt (restore falls
        back to PARTNER copies or L2).
        """
        if self._transfer is None or self.world_size == 1 or not self._thread.is_alive() or \
                not any(s.redundancy is Redundancy.XOR for s in self.specs):
            return []
        job = _Rebuild(self._transfer, self.rank, self.nodes, self._owners)
        self._queue.put(job)
        job.done.wait()
        return job.result

    def _rebuild(self, job: _Rebuild) -> None:
        try:
            for spec in (s for s in self.specs if s.redundancy is Redundancy.XOR):
                t0 = time.perf_counter()
                plan, out = rebuild_tier(job.transfer.get(), root=self.root(spec, job.rank), tier=spec.name,
                                         rank=job.rank, nodes=job.nodes, group_size=spec.group_size,
                                         limit=spec.keep, verify=self._verify, owners=job.owners[spec.name],
                                         ownership=self.ownership)
                job.result += [(plan.step, r, ok) for r, ok in out]
                # the outcome is the same on every rank: rank 0's event carries it, so a job's
                # log names each rebuilt rank once; the others report the plan and their time
                mine = job.rank == 0
                self._emit("checkpoint_rebuilt", tier=spec.name, plan=plan.why,
                           ranks=[r for r, ok in out if ok] if mine else [],
                           failed=[r for r, ok in out if not ok] if mine else [],
                           seconds=round(time.perf_counter() - t0, 4))
        except Exception as exc:  # reported; restore falls back to other copies
            log.warning("XOR rebuild failed: %s", exc)
            self._emit("checkpoint_rebuild_failed", error=first_line(exc))
        finally:
            job.done.set()

    def _verify(self, path: str) -> list[str]:
        """verify_shard, remembered per unchanged file (the rebuild scan and best() read once)."""
        try:
            st = os.stat(path)
        except OSError:
            return [f"missing shard {path}"]
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        if self._verified.get(path) == key:
            return []
        problems = verify_shard(path)
        if not problems:
            self._verified[path] = key
        return problems

    def candidates(self) -> list[tuple[int, str, str]]:
        """(step, source, path) this rank could restore from, newest first, cheapest first."""
        out: list[tuple[int, str, str]] = []
        if self._l0 is not None and self._l0.step >= 0:
            out.append((self._l0.step, "L0", ""))
        for spec in self.specs:
            if spec.storage == "memory":
                continue
            root = self.root(spec)
            for step, man in reversed(self.ownership.own(root, spec.name)):
                if spec.storage == "local" and self.rank in man.shards:
                    out.append((step, spec.name, layout.shard_path(root, step, self.rank)))
                elif spec.storage == "shared":
                    rank = self.rank if self.rank in man.shards else min(man.shards)
                    out.append((step, spec.name, layout.shard_path(root, step, rank)))
            proot = layout.partner_root(root)
            if spec.storage == "local" and os.path.isdir(proot):
                for step, man in reversed(self.ownership.own(proot, f"{spec.name}-partner")):
                    for r in man.shards:
                        out.append((step, f"{spec.name}-partner", layout.shard_path(proot, step, r)))
        order = {name: i for i, name in enumerate(["L0"] + [s.name for s in self.specs])}
        out.sort(key=lambda c: (-c[0], order.get(c[1].split("-")[0], 99), c[1]))
        return out

    def best(self) -> tuple[int, str, str] | None:
        """Newest valid candidate (checksums verified); corrupt ones are skipped and reported,
        and other runs' steps are not candidates (one ``checkpoint_foreign`` event)."""
        try:
            for step, source, path in self.candidates():
                if source == "L0":
                    return step, source, path
                problems = verify_rank_problems(path, self._verify)  # a dedup step: every file it reads
                if not problems:
                    return step, source, path
                self._emit("checkpoint_invalid", step=step, source=source, path=path, problems=problems[:3])
            return None
        finally:
            self.report_foreign()

    def load(self, candidate: tuple[int, str, str], into: Mapping[str, torch.Tensor] | None = None) -> Any:
        """The state of ``candidate`` (from ``best``), its tensors in ``into``'s (``flatten_state``
        names -> tensors, e.g. the rank's own state, CPU or GPU) where they fit, saving an
        allocation per tensor (from disk: read straight in); ``into``'s bytes are undefined after an error.

        Raises:
            CheckpointError: a file is missing or corrupt, or a checksum fails.
        """
        step, source, path = candidate
        if source == "L0":
            return unflatten_state(copies(self._l0.tensors, into), self._l0.skeleton)
        return read_rank_state(path, into=into)
