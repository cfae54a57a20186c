#!/usr/bin/env python3
"""A node-local (L1) restore into a GPU rank's device tensors: where the time goes (needs CUDA).

One shard of --size-gib written by the engine, then --repeat rounds, each from a cold
page cache (dropped where allowed), of four ways to bring it back:

* ``engine``: ``CheckpointEngine.load(into=device tensors)`` as the session restores:
  read into new host memory, then copied to the device (``hdf5_extents.onto_devices``);
* ``host_only``: the same read, stopping in host memory (the floor of any way);
* ``pinned_first``: pinned host tensors allocated for the read (the round's first,
  ``cudaHostAlloc`` included; then freed), read straight into them, non-blocking copies
  to the device: what a fresh process would pay;
* ``pinned_held``: the same into pinned tensors that already exist (allocated before
  timing): what a process that keeps pinned buffers of its state's shape pays.

Medians, min and max; --json gets every run.

    python3 benchmarks/restore_device.py --size-gib 0.5 --repeat 3 --json F
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint import drop_caches  # noqa: E402  (benchmarks/checkpoint.py: the same cold reads)
from figures import run_and_write, stats  # noqa: E402

WAYS = ("engine", "host_only", "pinned_first", "pinned_held")


def run(args) -> dict:
    from slurm_resilience.checkpoint.engine import CheckpointEngine
    from slurm_resilience.checkpoint.hdf5_format import flatten_state
    from slurm_resilience.checkpoint.shared_read import read_rank_state
    from slurm_resilience.checkpoint.tiers import TierSpec

    per = int(args.size_gib * (1 << 30) / 4 / args.tensors)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(per, generator=g, device="cuda") for i in range(args.tensors)}
    root = Path(tempfile.mkdtemp(prefix="restore-device-", dir=args.dir))
    eng = CheckpointEngine((TierSpec(name="L1", storage="local", interval_steps=1, path=str(root / "l1"), keep=1),),
                           job_id="bench", run_id="0" * 32, job_dir=str(root), node="n0")
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    try:
        eng.save(1, state)
        if not eng.wait(timeout=600):
            raise RuntimeError("the shard was not durable within 600 s")
        cand = next(c for c in eng.candidates() if c[1] == "L1")
        want = flatten_state(state)[0]
        dev = {k: torch.empty_like(v) for k, v in want.items()}
        held = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in dev.items()}
        cold = drop_caches()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)

        def to_device(host: dict) -> None:
            for k, v in dev.items():
                v.copy_(host[k], non_blocking=True)
            torch.cuda.synchronize()

        def pinned_first() -> None:
            if empty_host_cache is not None:
                empty_host_cache()  # no pinned block of an earlier round to reuse: a fresh process's cost
            pin = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in dev.items()}
            read_rank_state(cand[2], into=pin)
            to_device(pin)

        ways = {"engine": lambda: (eng.load(cand, into=dev), torch.cuda.synchronize()),
                "host_only": lambda: read_rank_state(cand[2]),
                "pinned_first": pinned_first,
                "pinned_held": lambda: (read_rank_state(cand[2], into=held), to_device(held))}
        for _ in range(args.repeat):
            for w in WAYS:
                for t in dev.values():
                    t.zero_()
                if cold:
                    drop_caches()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ways[w]()
                times[w].append(time.perf_counter() - t0)
                if w != "host_only" and not all(torch.equal(dev[k], v) for k, v in want.items()):
                    raise RuntimeError(f"{w}: the device tensors differ from the saved state")
    finally:
        eng.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"benchmark": "restore_device", "bytes": sum(t.numel() * 4 for t in state.values()),
            "device": torch.cuda.get_device_name(0), "reads": "cold" if cold else "warm",
            "pinned_first_from_empty_cache": empty_host_cache is not None,
            "figures": {w: stats(v) for w, v in times.items()}}


def report(figures: dict) -> str:
    gb = figures["bytes"] / 1e9
    lines = [f"{gb:.2f} GB to {figures['device']}, reads {figures['reads']}",
             f"{'way':<14}{'median s':>10}{'min':>8}{'max':>8}"]
    for w, f in figures["figures"].items():
        lines.append(f"{w:<14}{f['median_s']:>10.3f}{f['min_s']:>8.3f}{f['max_s']:>8.3f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every way (interleaved)")
    ap.add_argument("--dir", default=None, help="where to write (default: system temp)")
    ap.add_argument("--json", default="restore_device.json", help="write every figure here (default: %(default)s)")
    args = ap.parse_args()
    if args.repeat < 1 or args.size_gib <= 0 or args.tensors < 1:
        ap.error("--repeat and --tensors must be >= 1 and --size-gib > 0")
    if not torch.cuda.is_available():
        print("restore_device.py: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    return run_and_write(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
