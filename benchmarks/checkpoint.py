#!/usr/bin/env python3
"""Checkpoint benchmark: ours vs raw disk, torch.save and torch.distributed.checkpoint, like for like.

Same process, same state (a dict of fp32 tensors of --size-gib in all), and for every
contender (benchmarks/checkpoint_contenders.py) the same: two untimed warm-up writes and
one read, then --repeat timed rounds interleaved (raw, torch.save, DCP, ours, raw, ...),
``os.sync()`` before each contender, so a disk or a neighbour that changes speed mid-run
hits all alike; the ratios are also given per round. Writes are timed from the outside,
from the save call to durable (fsync'd; ours: to the engine's report that the step is
committed, before it prunes older steps); reads go into memory allocated before timing
(raw, DCP and ours alike; torch.load cannot) and start from the same cache state for
all: cold (page cache dropped before every read) where /proc/sys/vm/drop_caches is
writable, else warm (each contender reads its own file right after writing it).
Every contender that has a thread count writes with --threads threads (default: ours,
``shard_io.IO_THREADS``): raw, raw O_DIRECT, DCP's ``FileSystemWriter(thread_count=)``
and ours (its I/O pool set to --threads); torch.save and ``FileSystemReader`` have no
such knob and run in one thread; the JSON says so under ``threads``. Medians, min and
max are printed with each ratio next to its target; --json (default
checkpoint.json) gets every run.

    python3 benchmarks/checkpoint.py --size-mb 512 --repeat 3 --cpu
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint_contenders import DCP, Ours, Raw, RawDirect, TorchSave  # noqa: E402
from figures import run_and_write, stats  # noqa: E402
from slurm_resilience.checkpoint import shard_io  # noqa: E402
from slurm_resilience.checkpoint.shard_io import CRC32_IMPL, IO_THREADS  # noqa: E402

DROP = "/proc/sys/vm/drop_caches"
# (label, numerator, denominator, target, how to read it): ratio = numerator / denominator
TARGETS = [
    ("L1 persist vs raw parallel write", "raw_write", "ours_write", 0.85, ">= 0.85 of the disk's own speed"),
    ("L1 persist vs raw O_DIRECT write", "raw_direct_write", "ours_write", 0.85, ">= 0.85 of it, page cache bypassed"),
    ("L1 persist vs DCP save", "dcp_write", "ours_write", 1.0, "> 1: faster than DCP save"),
    ("L1 persist vs torch.save", "torch_save_write", "ours_write", 1.0, "> 1: faster than torch.save"),
    ("restore vs raw parallel read", "raw_read", "ours_read", 0.85, ">= 0.85 of the raw read"),
    ("restore vs raw O_DIRECT read", "raw_direct_read", "ours_read", 0.85, ">= 0.85 of it, page cache bypassed"),
    ("restore into new tensors vs raw read", "raw_read", "ours_read_new", 0.85, "(informative: no preallocation)"),
    ("restore vs DCP load", "dcp_read", "ours_read", 1.0, "> 1: faster than DCP load"),
    ("host copy / training stall", "host_copy", "ours_stall", 1 / 1.5, "stall <= 1.5x the host copy"),
]


def make_state(size_gib: float, n_tensors: int, device: str) -> dict:
    per = int(size_gib * (1 << 30) / 4 / n_tensors)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g).to(device) for i in range(n_tensors)}


def drop_caches() -> bool:
    """Drop the page cache (clean pages only: sync first); False where not allowed."""
    os.sync()
    try:
        with open(DROP, "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def host_copy_s(state: dict, device: str) -> float:
    """A plain device->host copy into preallocated (pinned with CUDA) buffers: the stall's floor."""
    bufs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in state.items()}

    def copy() -> None:
        for k, v in state.items():
            bufs[k].copy_(v, non_blocking=device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()

    copy()
    t0 = time.perf_counter()
    copy()
    return time.perf_counter() - t0


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    size_gib = args.size_mb / 1024 if args.size_mb else args.size_gib
    state = make_state(size_gib, args.tensors, device)
    root = Path(tempfile.mkdtemp(prefix="ckbench-", dir=args.dir))
    cold = drop_caches()
    contenders = [Raw(state, root, args.threads), RawDirect(state, root, args.threads)]
    if not args.skip_others:
        contenders += [TorchSave(state, root), DCP(state, root, args.threads)]
    contenders.append(Ours(state, root))
    times: dict[str, list[float]] = {}
    try:
        for c in contenders:  # the same untimed warm-up for every contender: two writes, one read
            for w in (1, 2):  # two: ours alternates between two host buffer sets
                handle = c.write(w)
                if w == 2:
                    c.read(handle)
                c.remove(handle)
        for i in range(1, args.repeat + 1):
            for c in contenders:
                os.sync()  # no dirty pages of the previous contender in this one's window
                t0 = time.perf_counter()
                handle = c.write(2 + i)
                end = time.perf_counter() if c.durable_at is None else c.durable_at
                times.setdefault(f"{c.name}_write", []).append(end - t0)
                if cold:
                    drop_caches()
                t0 = time.perf_counter()
                c.read(handle)
                times.setdefault(f"{c.name}_read", []).append(time.perf_counter() - t0)
                if isinstance(c, Ours):  # also into new tensors, as a fresh process without ``into``
                    if cold:
                        drop_caches()
                    t0 = time.perf_counter()
                    c.read_new(handle)
                    times.setdefault("ours_read_new", []).append(time.perf_counter() - t0)
                c.remove(handle)
        ours = contenders[-1]
        times["ours_stall"] = ours.stalls[-args.repeat:]
        times["host_copy"] = [host_copy_s(state, device) for _ in range(args.repeat)]
    finally:
        for c in contenders:
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    figures = {k: stats(v) for k, v in times.items()}
    ratios = {}
    for label, num, den, target, _ in TARGETS:
        if num in figures and den in figures:
            per_run = [a / b for a, b in zip(figures[num]["runs"], figures[den]["runs"])]
            med = figures[num]["median_s"] / figures[den]["median_s"]
            ratios[label] = {"median": med, "per_run": per_run, "target": target,
                             "met_in_every_run": all(r >= target for r in per_run)}
    return {"benchmark": "checkpoint", "bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "device": device, "repeat": args.repeat, "reads": "cold (page cache dropped)" if cold else
            "warm (read right after its own write)", "crc32": CRC32_IMPL, "io_threads": shard_io.IO_THREADS,
            "raw_threads": args.threads, "threads": threads_used(args.threads, args.skip_others),
            "figures": figures, "ratios": ratios}


def threads_used(threads: int, skip_others: bool) -> dict[str, int]:
    """The write/read threads of every contender of a run (those without a knob: 1)."""
    out = {"raw": threads, "raw_direct": threads, "ours": threads}
    if not skip_others:
        out.update({"dcp_save": threads, "dcp_load": 1, "torch_save": 1, "torch_load": 1})
    return out


LABELS = {"raw_write": Raw.write_label, "raw_read": Raw.read_label, "raw_direct_write": RawDirect.write_label,
          "raw_direct_read": RawDirect.read_label, "torch_save_write": TorchSave.write_label,
          "torch_save_read": TorchSave.read_label, "dcp_write": DCP.write_label, "dcp_read": DCP.read_label,
          "ours_write": Ours.write_label, "ours_read": Ours.read_label, "ours_read_new": Ours.read_new_label,
          "ours_stall": "ours: training stall (save() returns)", "host_copy": "host copy (floor for the stall)"}


def report(r: dict) -> str:
    gb = r["bytes"] / 1e9
    lines = [f"state: {gb:.2f} GB on {r['device']}; {r['repeat']} interleaved rounds after the same warm-up "
             "(two writes, one read); "
             f"reads {r['reads']}; ours: CRC32 from {r['crc32']}; threads {r.get('threads', r['io_threads'])}",
             f"{'what':<44}{'median s':>10}{'min':>8}{'max':>8}{'GB/s':>8}"]
    for key, label in LABELS.items():
        if key in r["figures"]:
            f = r["figures"][key]
            lines.append(f"{label:<44}{f['median_s']:>10.3f}{f['min_s']:>8.3f}{f['max_s']:>8.3f}"
                         f"{gb / f['median_s']:>8.2f}")
    lines.append(f"{'ratio (median)':<44}{'value':>10}{'target':>8}   per run; every run meets it?")
    for label, *_, how in TARGETS:
        if label in r["ratios"]:
            x = r["ratios"][label]
            lines.append(f"{label:<44}{x['median']:>10.2f}{x['target']:>8.2f}   "
                         f"{' '.join(f'{v:.2f}' for v in x['per_run'])}; {'yes' if x['met_in_every_run'] else 'NO'}"
                         f"  ({how})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--size-mb", type=float, default=None, help="state size in MiB (overrides --size-gib)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds of every contender (interleaved)")
    ap.add_argument("--skip-others", action="store_true", help="skip torch.save and DCP")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--threads", type=int, default=IO_THREADS,
                    help="write/read threads of every contender that has a thread count (default: %(default)s, ours)")
    ap.add_argument("--dir", default=None, help="where to write (default: system temp)")
    ap.add_argument("--cpu", action="store_true", help="keep the state on the CPU even with CUDA")
    ap.add_argument("--json", default="checkpoint.json", help="write every figure here (default: %(default)s)")
    args = ap.parse_args()
    if args.repeat < 1 or args.threads < 1:
        ap.error(f"--repeat={args.repeat} and --threads={args.threads} must be >= 1")
    shard_io.IO_THREADS = args.threads  # ours reads its pool size at each call: the same threads for all
    return run_and_write(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
