"""The contenders of benchmarks/checkpoint.py: each writes the same state durably and reads it back.

Every contender is timed from the outside, from the call that starts its save to the
moment its bytes are durable (fsync'd), and from the call that starts its read to
the moment the state is in memory. Ours: ``engine.save`` + ``engine.wait`` (the L0
copy, then the L1 HDF5 write, fsync and commit), not the engine's own timer.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch


class Contender:
    """``write(i) -> handle`` (durable when it returns), ``read(handle)``, ``remove(handle)``.

    ``durable_at``: where a contender does more than persisting before ``write`` returns
    (ours: retention of older steps), the ``time.perf_counter()`` at which the bytes were
    durable and committed, seen from outside the writer; None: when ``write`` returned.
    """

    name = "?"
    write_label = read_label = "?"
    durable_at: float | None = None

    def write(self, i: int) -> Any:
        raise NotImplementedError

    def read(self, handle: Any) -> None:
        raise NotImplementedError

    def remove(self, handle: Any) -> None:
        shutil.rmtree(handle, ignore_errors=True) if Path(handle).is_dir() else Path(handle).unlink(missing_ok=True)

    def close(self) -> None:
        pass


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parallel(jobs: list[Callable[[], None]], threads: int) -> None:
    chunks = [jobs[i::threads] for i in range(threads)]
    ts = [threading.Thread(target=lambda c=c: [j() for j in c]) for c in chunks if c]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class Raw(Contender):
    """One file per tensor, written by ``threads`` threads (write + fsync), read with
    ``readinto`` into buffers allocated once, before any timing: the disk's own speed."""

    name, write_label, read_label = "raw", "raw parallel write+fsync", "raw parallel read (into buffers)"

    def __init__(self, state: dict, root: Path, threads: int) -> None:
        self.state, self.root, self.threads = state, root, threads
        self.bufs = {k: bytearray(v.numel() * v.element_size()) for k, v in state.items()}

    def write(self, i: int) -> Path:
        d = self.root / f"raw-{i}"
        d.mkdir(parents=True)

        def one(name: str, t: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                with open(d / f"{name}.bin", "wb") as f:
                    f.write(memoryview(t.cpu().numpy()) if t.is_cuda else memoryview(t.numpy()))
                    f.flush()
                    os.fsync(f.fileno())
            return run

        _parallel([one(k, v) for k, v in self.state.items()], self.threads)
        return d

    def read(self, d: Path) -> None:
        def one(name: str) -> Callable[[], None]:
            def run() -> None:
                view = memoryview(self.bufs[name])
                with open(d / f"{name}.bin", "rb", buffering=0) as f:
                    got = 0
                    while got < len(view):
                        n = f.readinto(view[got:])
                        if not n:
                            raise IOError(f"short read of {name}")
                        got += n
            return run

        _parallel([one(k) for k in self.state], self.threads)


class RawDirect(Raw):
    """Raw's files and threads with O_DIRECT, written from and read into 4 KiB-aligned
    buffers allocated before timing (copies of the state, as ours' host buffers):
    the disk's speed without the page cache. A tensor's unaligned tail goes buffered."""

    name, write_label, read_label = "raw_direct", "raw parallel write+fsync, O_DIRECT", \
        "raw parallel read, O_DIRECT (into buffers)"

    def __init__(self, state: dict, root: Path, threads: int) -> None:
        from slurm_resilience.checkpoint.hdf5_extents import aligned_empty

        self.root, self.threads = root, threads
        self.state = {k: aligned_empty(tuple(v.shape), v.dtype).copy_(v.cpu()) for k, v in state.items()}
        self.bufs = {k: aligned_empty(tuple(v.shape), v.dtype) for k, v in state.items()}

    @staticmethod
    def _io(path: Path, flags: int, view: memoryview, op: Callable[[int, memoryview, int], int]) -> None:
        from slurm_resilience.checkpoint.shard_io import ALIGN

        body = len(view) - len(view) % ALIGN
        for fd, lo, hi in ((os.open(path, flags | os.O_DIRECT, 0o600), 0, body),
                           (os.open(path, flags, 0o600), body, len(view))):
            try:
                done = lo
                while done < hi:
                    n = op(fd, view[done:hi], done)
                    if n <= 0:
                        raise IOError(f"short I/O on {path}")
                    done += n
                if flags & os.O_WRONLY and hi == len(view):
                    os.fsync(fd)
            finally:
                os.close(fd)

    def write(self, i: int) -> Path:
        d = self.root / f"rawd-{i}"
        d.mkdir(parents=True)
        flags = os.O_WRONLY | os.O_CREAT
        _parallel([lambda k=k, t=t: self._io(d / f"{k}.bin", flags, memoryview(t.numpy()).cast("B"), os.pwrite)
                   for k, t in self.state.items()], self.threads)
        return d

    def read(self, d: Path) -> None:
        _parallel([lambda k=k, t=t: self._io(d / f"{k}.bin", os.O_RDONLY, memoryview(t.numpy()).cast("B"),
                                             lambda fd, v, o: os.preadv(fd, [v], o))
                   for k, t in self.bufs.items()], self.threads)


class TorchSave(Contender):
    name, write_label, read_label = "torch_save", "torch.save (+fsync)", "torch.load"

    def __init__(self, state: dict, root: Path) -> None:
        self.state, self.root = state, root

    def write(self, i: int) -> Path:
        p = self.root / f"torch-{i}.pt"
        torch.save(self.state, p)
        _fsync(str(p))
        return p

    def read(self, p: Path) -> None:
        torch.load(p, map_location="cpu")


class DCP(Contender):
    """torch.distributed.checkpoint save/load (a world of one; its writer fsyncs its files),
    written by ``FileSystemWriter`` with ``threads`` threads (as raw and ours; its own
    default is one) and loaded into tensors allocated once (``FileSystemReader`` has no
    thread count: it reads in the calling thread)."""

    name, write_label, read_label = "dcp", "DCP save", "DCP load (into tensors)"

    def __init__(self, state: dict, root: Path, threads: int) -> None:
        import torch.distributed as dist

        self.state, self.root, self.threads = state, root, threads
        self.target = {k: torch.empty_like(v) for k, v in state.items()}
        self._store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
        dist.init_process_group("gloo", store=self._store, rank=0, world_size=1)

    def write(self, i: int) -> Path:
        import torch.distributed.checkpoint as dcp

        d = self.root / f"dcp-{i}"  # the writer's thread count, as raw's and ours (its default is 1)
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(str(d), thread_count=self.threads))
        return d

    def read(self, d: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.target, checkpoint_id=str(d))

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class Ours(Contender):
    """The engine with L0 (memory) and L1 (local HDF5): ``save`` + ``wait`` = durable in L1,
    its end taken when the engine reports the step durable and committed (``latest``
    moved: the ``checkpoint_durable`` event), before it prunes the previous step. Reads
    (``load``) go into tensors allocated once, before any timing, as raw's and DCP's.
    ``stalls`` keeps what ``save`` itself blocked (the training stall)."""

    name, write_label, read_label = "ours", "ours: L1 persist (save call -> durable)", "ours: restore (read+verify)"
    read_new_label = "ours: restore into new tensors"

    def __init__(self, state: dict, root: Path) -> None:
        from slurm_resilience.checkpoint.engine import CheckpointEngine
        from slurm_resilience.checkpoint.tiers import TierSpec

        self.state, self.root = state, root
        specs = (TierSpec(name="L0", storage="memory", interval_steps=1),
                 TierSpec(name="L1", storage="local", interval_steps=1, path=str(root / "ours"), keep=1))
        self.eng = CheckpointEngine(specs, job_id="bench", run_id="0" * 32, job_dir=str(root), node="n0",
                                    emit=self._event)
        from slurm_resilience.checkpoint.hdf5_format import flatten_state

        self.target = {k: torch.empty_like(v) for k, v in flatten_state(state)[0].items()}  # as the shard names them
        self.stalls: list[float] = []
        self.loaded: Any = None

    def _event(self, kind: str, **fields: Any) -> None:
        if kind == "checkpoint_durable" and fields.get("tier") == "L1":
            self.durable_at = time.perf_counter()

    def write(self, i: int) -> tuple[int, str, str]:
        from slurm_resilience.checkpoint import layout

        self.durable_at = None
        self.stalls.append(self.eng.save(i, self.state))
        if not self.eng.wait(timeout=600) or self.durable_at is None:
            raise RuntimeError("ours: L1 write not durable within 600 s")
        return (i, "L1", layout.shard_path(str(self.root / "ours"), i, 0))

    def read(self, cand: tuple[int, str, str]) -> None:
        self.loaded = self.eng.load(cand, into=self.target)  # checked in remove(), untimed

    def read_new(self, cand: tuple[int, str, str]) -> None:
        self.eng.load(cand)

    def remove(self, cand: tuple[int, str, str]) -> None:
        from slurm_resilience.checkpoint.hdf5_format import flatten_state

        loaded, self.loaded = self.loaded, None  # keep=1: the engine prunes its older steps itself
        if loaded is None:  # written, not read (the first warm-up write)
            return
        got = flatten_state(loaded)[0]
        if any(got[k] is not t for k, t in self.target.items()) or \
                any(not torch.equal(got[k], t) for k, t in flatten_state(self.state)[0].items()):
            raise RuntimeError("ours: restore did not read the state into the preallocated tensors")

    def close(self) -> None:
        self.eng.close()
