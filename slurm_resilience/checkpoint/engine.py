"""The per-rank checkpoint engine: a blocking host copy, the rest in the background.

    save(step, state)                      training thread, at a safe point
      └─ L0: copy tensors device→host into reused buffers (pinned with CUDA)   ← the only stall
    writer thread, checkpoints in step order (identical order on every rank):
      ├─ L1: HDF5 shard on the node-local disk (atomic, checksummed)
      │     PARTNER: shard bytes → partner rank over the transfer group; its copy → our disk
      │     XOR: parity row of our group, exchanged over the transfer group → our disk
      ├─ vote: every rank reports durable/failed (collective on the transfer group)
      │     all durable → manifest, then ``latest`` (never before)
      └─ L2: every K-th: shard copied to the shared filesystem, vote, rank 0 commits

A failing checkpoint (disk full, I/O error, a peer lost mid-transfer) is reported
as an event, never raised into training, and never touches an older checkpoint.

Restore: :meth:`CheckpointEngine.rebuild_missing` (collective) first rebuilds XOR
shards lost with a node into the rank that now holds the slot; then every rank
walks ``candidates()`` fastest-first, verifying checksums (``best``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..errors import CheckpointError
from ..files import makedirs_private, write_private
from . import manifest as mf
from .hdf5_format import flatten_state, read_shard, shard_crc32, unflatten_state, verify_shard, write_shard
from .partner_tier import exchange_partner
from .tiers import IntervalEstimator, Redundancy, TierSpec, base_tier, expand_path, tier_for_step
from .xor_rebuild import rebuild_tier
from .xor_tier import encode_step, parity_name

log = logging.getLogger(__name__)

PARTNER_DIR = "partner"


@dataclasses.dataclass
class _BufferSet:
    tensors: dict[str, torch.Tensor]
    skeleton: bytes = b""
    step: int = -1
    busy: bool = False


@dataclasses.dataclass
class _Job:
    step: int
    tiers: list[str]
    buffers: _BufferSet
    transfer: Any
    rank: int
    world_size: int
    nodes: tuple[str, ...]


@dataclasses.dataclass
class _Rebuild:
    transfer: Any
    rank: int
    nodes: tuple[str, ...]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: list[tuple[int, int, bool]] = dataclasses.field(default_factory=list)


class CheckpointEngine:
    """Multi-level checkpoints of one rank. Not thread-safe: one caller (the training loop)."""

    def __init__(self, specs: Sequence[TierSpec], *, job_id: str, job_dir: str, node: str,
                 emit: Callable[..., None] = lambda kind, **f: None, mtbf_s: float = 86400.0) -> None:
        self.specs = tuple(specs)
        self._by_storage = {s.storage: s for s in reversed(self.specs)}
        self.job_id, self.job_dir, self.node = job_id, job_dir, node
        self._emit = emit
        self._pinned = torch.cuda.is_available()
        self._sets = [_BufferSet({}), _BufferSet({})]
        self._l0: _BufferSet | None = None
        self._lock = threading.Condition()
        self._queue: "queue.Queue[_Job | _Rebuild | None]" = queue.Queue()
        self._last: dict[str, tuple[int, float]] = {}
        self._counts: dict[str, int] = {}
        self.estimator = IntervalEstimator(mtbf_s=mtbf_s) if any(s.auto for s in self.specs) else None
        self.rank, self.world_size, self.nodes, self._transfer = 0, 1, (node,), None
        self.stats: list[dict[str, float]] = []
        self.failures: list[tuple[int, str]] = []  # (step, why) of checkpoints not committed
        self._verified: dict[str, tuple[int, int, int]] = {}  # path -> stat key of a verified shard
        self._thread = threading.Thread(target=self._writer, name="sr-ckpt-writer", daemon=True)
        self._thread.start()

    # -- membership ------------------------------------------------------------
    def bind(self, *, rank: int, world_size: int, nodes: Sequence[str],
             transfer: Callable[[], Any] | None) -> None:
        """A new generation: rank, world, and a factory for the writer's transfer group.

        The group is built lazily by the writer thread at the generation's first
        checkpoint (every rank reaches it at the same step), so rebuilding it is
        off the recovery's critical path.
        """
        self.rank, self.world_size, self.nodes = rank, world_size, tuple(nodes)
        self._transfer = _Lazy(transfer) if transfer is not None else None

    @property
    def needs_agreement(self) -> bool:
        """Time/auto intervals differ per rank: the caller must agree on ``due`` collectively."""
        return any(s.interval_s is not None or s.auto for s in self.specs)

    def root(self, spec: TierSpec, rank: int | None = None) -> str:
        return expand_path(spec, job_id=self.job_id, node=self.node,
                           rank=self.rank if rank is None else rank, job_dir=self.job_dir)

    # -- save --------------------------------------------------------------------
    def due(self, step: int) -> list[str]:
        autos = {}
        if self.estimator is not None:
            autos = {s.name: self.estimator.interval_steps() for s in self.specs if s.auto}
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
            self._queue.put(_Job(step, disk, buf, self._transfer, self.rank, self.world_size, self.nodes))
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
                self.failures.append((job.step, _line(exc)))
                self._emit("checkpoint_failed", step=job.step, tiers=job.tiers, error=_line(exc))
            finally:
                with self._lock:
                    job.buffers.busy = False
                    self._lock.notify_all()

    def _persist(self, job: _Job) -> None:
        state = unflatten_state(job.buffers.tensors, job.buffers.skeleton)
        attrs = {"step": job.step, "rank": job.rank, "world_size": job.world_size}
        local_path = None
        for name in job.tiers:
            spec = self._spec(name)
            t0 = time.perf_counter()
            root = self.root(spec, job.rank)
            if spec.storage == "local":
                local_path, nbytes = self._persist_local(spec, root, job, state, attrs)
            else:
                nbytes = self._persist_shared(spec, root, job, state, attrs, local_path)
            dt = time.perf_counter() - t0  # until committed (latest moved); pruning is after
            self.stats.append({"tier": name, "step": job.step, "seconds": dt, "bytes": nbytes})
            self._emit("checkpoint_durable", step=job.step, tier=name, seconds=round(dt, 4),
                       bytes=nbytes)
            if spec.storage == "local":
                mf.prune(root, keep_last=spec.keep)

    def _persist_local(self, spec, root, job, state, attrs):
        path = mf.shard_path(root, job.step, job.rank)
        ok, info, err = 1, None, ""
        try:
            info = write_shard(path, state, attrs=attrs)
        except (OSError, CheckpointError) as exc:
            ok, err = 0, _line(exc)
        copies: dict[int, mf.ShardRecord] = {}
        extra: dict[str, Any] = {}
        if spec.redundancy is Redundancy.PARTNER and job.world_size > 1:
            copies = exchange_partner(job.transfer.get(), os.path.join(root, PARTNER_DIR), step=job.step,
                                      rank=job.rank, nodes=job.nodes, path=path if ok else None)
        elif spec.redundancy is Redundancy.XOR and job.world_size > 1:
            size, why = encode_step(job.transfer.get(), root_step_dir=mf.step_dir(root, job.step), step=job.step,
                                    rank=job.rank, nodes=job.nodes, group_size=spec.group_size,
                                    shard=(path, info.nbytes, info.crc32) if ok else None)
            ok, err = (0, err or why) if why else (ok, err)
            extra = {"xor": {"parity": parity_name(job.rank), "nbytes": size}}
        votes = self._vote(job, ok)
        if not all(votes):
            failed = [r for r, v in enumerate(votes) if not v]
            raise CheckpointError(f"step {job.step} not committed on {spec.name}: ranks {failed} failed"
                                  + (f" (here: {err})" if err else ""))
        man = mf.Manifest(step=job.step, world_size=job.world_size, tier=spec.name,
                          shards={job.rank: mf.ShardRecord(os.path.basename(path), info.nbytes, info.crc32)},
                          created=time.time(), extra=extra)
        mf.write_manifest(root, man)
        if copies:  # the partner copies this node holds form a tier root of their own
            proot = os.path.join(root, PARTNER_DIR)
            mf.write_manifest(proot, mf.Manifest(step=job.step, world_size=job.world_size,
                                                 tier=f"{spec.name}-partner", shards=copies,
                                                 created=time.time(), extra={}))
            mf.prune(proot, keep_last=spec.keep)
        mf.set_latest(root, job.step)
        return path, info.nbytes

    def _persist_shared(self, spec, root, job, state, attrs, local_path) -> int:
        path = mf.shard_path(root, job.step, job.rank)
        ok, nbytes, crc = 1, 0, 0
        try:
            if local_path and os.path.exists(local_path):
                makedirs_private(os.path.dirname(path))
                with open(local_path, "rb") as f:
                    write_private(path, f.read())
                nbytes, crc = os.path.getsize(path), shard_crc32(path)
            else:
                info = write_shard(path, state, attrs=attrs)
                nbytes, crc = info.nbytes, info.crc32
        except (OSError, CheckpointError) as exc:
            ok = 0
            log.warning("L2 write failed: %s", exc)
        votes = self._vote(job, ok)
        if not all(votes):
            raise CheckpointError(f"step {job.step} not committed on {spec.name}: ranks "
                                  f"{[r for r, v in enumerate(votes) if not v]} failed")
        sizes = _gather(job, nbytes)
        crcs = _gather(job, crc)
        if job.rank == 0:
            shards = {r: mf.ShardRecord(f"rank-{r:05d}.h5", sizes[r], crcs[r]) for r in range(job.world_size)}
            mf.write_manifest(root, mf.Manifest(step=job.step, world_size=job.world_size, tier=spec.name,
                                                shards=shards, created=time.time(), extra={}))
            mf.set_latest(root, job.step)
            mf.prune(root, keep_last=spec.keep, keep_every=spec.keep_every)
        _gather(job, 1)  # nobody reports L2 durable before rank 0 committed
        return nbytes

    def _vote(self, job: _Job, ok: int) -> list[int]:
        """Collective: every rank's durable flag."""
        return _gather(job, ok)

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
        job = _Rebuild(self._transfer, self.rank, self.nodes)
        self._queue.put(job)
        job.done.wait()
        return job.result

    def _rebuild(self, job: _Rebuild) -> None:
        try:
            for spec in (s for s in self.specs if s.redundancy is Redundancy.XOR):
                t0 = time.perf_counter()
                plan, out = rebuild_tier(job.transfer.get(), root=self.root(spec, job.rank), tier=spec.name,
                                         rank=job.rank, nodes=job.nodes, group_size=spec.group_size,
                                         limit=spec.keep, verify=self._verify)
                job.result += [(plan.step, r, ok) for r, ok in out]
                self._emit("checkpoint_rebuilt", tier=spec.name, plan=plan.why, ranks=[r for r, ok in out if ok],
                           failed=[r for r, ok in out if not ok], seconds=round(time.perf_counter() - t0, 4))
        except Exception as exc:  # reported; restore falls back to other copies
            log.warning("XOR rebuild failed: %s", exc)
            self._emit("checkpoint_rebuild_failed", error=_line(exc))
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
            for step in reversed(mf.complete_steps(root)):
                man = mf.read_manifest(root, step)
                if spec.storage == "local" and self.rank in man.shards:
                    out.append((step, spec.name, mf.shard_path(root, step, self.rank)))
                elif spec.storage == "shared":
                    rank = self.rank if self.rank in man.shards else min(man.shards)
                    out.append((step, spec.name, mf.shard_path(root, step, rank)))
            proot = os.path.join(root, PARTNER_DIR)
            if spec.storage == "local" and os.path.isdir(proot):
                for step in reversed(mf.complete_steps(proot)):
                    for r in mf.read_manifest(proot, step).shards:
                        out.append((step, f"{spec.name}-partner", mf.shard_path(proot, step, r)))
        order = {name: i for i, name in enumerate(["L0"] + [s.name for s in self.specs])}
        out.sort(key=lambda c: (-c[0], order.get(c[1].split("-")[0], 99), c[1]))
        return out

    def best(self) -> tuple[int, str, str] | None:
        """Newest valid candidate (checksums verified); corrupt ones are skipped and reported."""
        for step, source, path in self.candidates():
            if source == "L0":
                return step, source, path
            problems = self._verify(path)
            if not problems:
                return step, source, path
            self._emit("checkpoint_invalid", step=step, source=source, path=path, problems=problems[:3])
        return None

    def load(self, candidate: tuple[int, str, str]) -> Any:
        step, source, path = candidate
        if source == "L0":
            return unflatten_state({k: v.clone() for k, v in self._l0.tensors.items()}, self._l0.skeleton)
        state, _ = read_shard(path)
        return state


class _Lazy:
    """Builds the transfer group on first use (in the writer thread), once."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory, self._group = factory, None

    def get(self) -> Any:
        if self._group is None:
            self._group = self._factory()
        return self._group


def _gather(job: _Job, value: int) -> list[int]:
    if job.transfer is None or job.world_size == 1:
        return [value]
    return job.transfer.get().all_gather_ints(int(value))


def _line(exc: BaseException) -> str:
    s = str(exc).strip()
    return (s.splitlines()[0] if s else type(exc).__name__)[:300]
