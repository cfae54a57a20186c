#!/usr/bin/env python3
"""Where the checkpoint write and restore spend their time: per phase, beside raw writers and readers.

Companion of benchmarks/checkpoint.py (issue 13). The same state (fp32 tensors of
--size-mb in all); rounds interleave every variant, ``os.sync()`` before each and the
page cache dropped before each read (when allowed), so all see the same cache state.

Writes (each from the first byte to durable), of 4 KiB-aligned copies of the state:
  ours       the shard write of ``hdf5_format`` phase by phase: layout (mkstemp + h5py
             metadata), data (``shard_io.write_extents``: CRC32 + pwrite through the page
             cache in the pool), attrs (h5py reopens to store the CRCs), fsync, rename
             (+ directory fsync), manifest and latest (each ``files.write_private``: write,
             fsync, rename, directory fsync), then prune (the previous step's directory; not persist)
  ours-direct    the same with the bulk bytes O_DIRECT (``write_shard(direct=True)``)
  raw32      one file per tensor, --threads threads, write + fsync each (checkpoint.py's raw)
  raw1-direct    one file, 8 MiB O_DIRECT pwrites by --threads threads, one fsync
Reads (cold):
  raw32      readinto buffers allocated before timing (checkpoint.py's raw read)
  ours       ``read_shard`` (allocates, preadv + CRC32 in the pool)
  ours-into  the same bytes into buffers allocated before timing (``read_shard(into=...)``)
  ours-into-8m   the same with one 8 MiB preadv per task instead of 1 MiB pieces
  fault      touching fresh memory of the state's size (no I/O): what allocating costs

    python3 benchmarks/checkpoint_phases.py --size-mb 512 --repeat 3
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint import drop_caches, make_state  # noqa: E402
from checkpoint_contenders import Raw, _parallel  # noqa: E402
from figures import run_and_write, stats  # noqa: E402
from slurm_resilience.checkpoint import hdf5_format as h5f, shard_io  # noqa: E402
from slurm_resilience.checkpoint.hdf5_extents import ALIGN_ABOVE, aligned_empty, bytes_of, to_numpy  # noqa: E402
from slurm_resilience.files import fsync_dir, write_private  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now


def write_ours(d: Path, state: dict, direct: bool) -> dict[str, float]:
    """hdf5_format.write_flat + the L1 commit, phase by phase (the same calls)."""
    import h5py

    from slurm_resilience.checkpoint.hdf5_extents import DatasetLayout

    c = Clock()
    d.mkdir(parents=True)
    path = str(d / "rank-0.h5")
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    os.close(fd)
    tensors, skeleton = h5f.flatten_state(state)
    arrays = {k: to_numpy(t) for k, t in tensors.items()}
    extents = {}
    with h5py.File(tmp, "w", libver="latest", locking=False, alignment_threshold=ALIGN_ABOVE,
                   alignment_interval=shard_io.ALIGN) as f:
        f.attrs["format"] = h5f.FORMAT
        lay = DatasetLayout(f)
        for name, (arr, tdt) in arrays.items():
            extents[name] = lay.create(name, arr, tdt)
        f.create_dataset(h5f.SKELETON, data=np.frombuffer(skeleton, dtype=np.uint8)).attrs["crc32"] = \
            np.uint32(shard_io.crc32(skeleton))
    c.lap("layout")
    fd = os.open(tmp, os.O_WRONLY)
    dfd = shard_io.open_direct(tmp, os.O_WRONLY) if direct else None
    crcs = shard_io.write_extents(fd, [(off, bytes_of(arrays[n][0])) for n, off in extents.items()], direct_fd=dfd)
    if dfd is not None:
        os.close(dfd)
    c.lap("data")
    with h5py.File(tmp, "r+", locking=False) as f:
        for name, crc in zip(extents, crcs):
            h5py.h5a.open(h5py.h5o.open(f.id, name.encode()), b"crc32").write(np.array(crc, np.uint32))
    c.lap("attrs")
    os.fsync(fd)
    os.close(fd)
    c.lap("fsync")
    os.replace(tmp, path)
    fsync_dir(str(d))
    c.lap("rename")
    write_private(str(d / "manifest.json"), "{}")
    c.lap("manifest")
    write_private(str(d.parent / f"latest-{d.name}"), "1\n")
    c.lap("latest")
    return c.phases


def write_raw1_direct(d: Path, state: dict, threads: int) -> dict[str, float]:
    """Every tensor (aligned memory, sizes multiples of 4 KiB here) at an aligned offset of one file."""
    c = Clock()
    d.mkdir(parents=True)
    fd = os.open(d / "all.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    views, off = [], 0
    for t in state.values():
        views.append((off, memoryview(t.numpy()).cast("B")))
        off += -(-t.numel() * t.element_size() // shard_io.ALIGN) * shard_io.ALIGN
    chunk = shard_io.CHUNK
    jobs = [(o + s, v[s:s + chunk]) for o, v in views for s in range(0, len(v), chunk)]
    _parallel([lambda o=o, v=v: os.pwrite(fd, v, o) for o, v in jobs], threads)
    c.lap("data")
    os.fsync(fd)
    os.close(fd)
    c.lap("fsync")
    return c.phases


def read_ours(path: str, into: dict | None) -> None:
    h5f.read_shard(path, into=into)


def run(args) -> dict:
    state = {k: aligned_empty(tuple(v.shape), v.dtype).copy_(v)  # so that ours-direct can go direct
             for k, v in make_state(args.size_mb / 1024, args.tensors, "cpu").items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="ckphase-", dir=args.dir))
    cold = drop_caches()
    raw = Raw(state, root, args.threads)
    into = {k: torch.empty_like(v) for k, v in h5f.flatten_state(state)[0].items()}
    for t in into.values():
        t.fill_(0)  # fault the pages in before timing, as raw's buffers
    times: dict[str, list[float]] = {}

    def rec(name: str, value: float) -> None:
        times.setdefault(name, []).append(value)

    prev: Path | None = None
    try:
        for i in range(args.repeat + 1):  # round 0: the untimed warm-up of everything
            keep = i > 0
            for variant in ("raw32", "ours", "raw1-direct", "ours-direct"):
                os.sync()
                t0 = time.perf_counter()
                d = root / f"{variant}-{i}"
                if variant == "raw32":
                    d = raw.write(i)
                    phases = {}
                elif variant == "raw1-direct":
                    phases = write_raw1_direct(d, state, args.threads)
                else:
                    phases = write_ours(d, state, direct=variant == "ours-direct")
                total = time.perf_counter() - t0
                if keep:
                    rec(f"write_{variant}", total)
                    for k, v in phases.items():
                        rec(f"write_{variant}.{k}", v)
                if variant == "ours":
                    if prev is not None:
                        t0 = time.perf_counter()
                        shutil.rmtree(prev)
                        fsync_dir(str(root))
                        if keep:
                            rec("write_ours.prune(after)", time.perf_counter() - t0)
                    prev = d
                    ours_path = str(d / "rank-0.h5")
                elif variant == "raw32":
                    raw_dir = d
                else:
                    shutil.rmtree(d)
            for variant in ("raw32", "ours", "ours-into", "ours-into-8m", "fault"):
                if cold:
                    drop_caches()
                t0 = time.perf_counter()
                if variant == "raw32":
                    raw.read(raw_dir)
                elif variant == "fault":  # fresh anonymous memory (malloc would hand back freed pages)
                    for v in state.values():
                        m = mmap.mmap(-1, v.numel() * v.element_size())
                        np.frombuffer(m, dtype=np.uint8)[::4096] = 1
                        m.close()
                elif variant == "ours-into-8m":  # each chunk in one preadv, then its CRC
                    step, shard_io._STEP = shard_io._STEP, shard_io.CHUNK
                    try:
                        read_ours(ours_path, into)
                    finally:
                        shard_io._STEP = step
                else:
                    read_ours(ours_path, into if variant == "ours-into" else None)
                if keep:
                    rec(f"read_{variant}", time.perf_counter() - t0)
            shutil.rmtree(raw_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"benchmark": "checkpoint_phases", "bytes": nbytes, "repeat": args.repeat, "cold_reads": cold,
            "threads": args.threads, "io_threads": shard_io.IO_THREADS, "crc32": shard_io.CRC32_IMPL,
            "figures": {k: stats(v) for k, v in times.items()}}


def report(r: dict) -> str:
    lines = [f"{r['bytes'] / 1e9:.2f} GB, {r['repeat']} rounds, cold reads: {r['cold_reads']}",
             f"{'what':<34}{'median s':>10}{'min':>8}{'max':>8}   runs"]
    for k, f in r["figures"].items():
        lines.append(f"{k:<34}{f['median_s']:>10.4f}{f['min_s']:>8.4f}{f['max_s']:>8.4f}   "
                     + " ".join(f"{x:.3f}" for x in f["runs"]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--threads", type=int, default=shard_io.IO_THREADS)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default="checkpoint_phases.json")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat={args.repeat} must be >= 1")
    return run_and_write(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
