#!/usr/bin/env python3
"""L2 bytes and persist time per checkpoint, full shards vs deduplicated, like for like.

N ranks (threads of this process, each with its own CheckpointEngine and a real gloo
transfer group) hold the same replicated state (a model of --size-mb MiB of fp32
tensors, and a per-rank RNG state) and checkpoint to L1 (per-rank node directory)
and L2 (one shared directory) at every step. Rounds alternate the L2 mode: full
(every rank writes its whole shard: the L1 file's bytes, as before) and dedup (each
replicated tensor written by its owner only, ``checkpoint/dedup.py``); one untimed
warm-up checkpoint of each first. Per checkpoint: L2 bytes written by all ranks
(the sum of the engines' L2 ``bytes`` stats, which are the files' sizes) and the
L2 persist time (the slowest rank's, from the start of its L2 write to the commit).
Also rank 0's restore from each L2 step (verify every file it reads + read, warm
page cache for both modes). Medians, min and max; --json gets every run.

    python3 benchmarks/l2_dedup.py --ranks 4 --size-mb 64 --repeat 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience.checkpoint import layout  # noqa: E402
from slurm_resilience.checkpoint.engine import CheckpointEngine  # noqa: E402
from slurm_resilience.checkpoint.shared_read import read_rank_state, verify_rank_problems  # noqa: E402
from slurm_resilience.checkpoint.tiers import TierSpec  # noqa: E402
from slurm_resilience.model import RankSlot, RankTable  # noqa: E402
from slurm_resilience.worker.reconnect import Generation  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402


def make_state(rank: int, size_mb: float, n_tensors: int) -> dict:
    per = int(size_mb * (1 << 20) / 4 / n_tensors)
    g = torch.Generator().manual_seed(0)  # the same model on every rank: replicated
    model = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n_tensors)}
    return {"objects": {"model": model}, "rng": torch.Generator().manual_seed(rank).get_state(), "step": 0}


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run(args) -> dict:
    world, root = args.ranks, Path(tempfile.mkdtemp(prefix="sr-l2-dedup-", dir=args.dir))
    nodes = [f"n{i}" for i in range(world)]
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    table = RankTable(generation=0, slots=tuple(RankSlot(rank=i, node=n, worker_id=f"w{i}", local_rank=0)
                                                for i, n in enumerate(nodes)))
    specs = (TierSpec(name="L1", storage="local", interval_steps=1, path=str(root) + "/{node}/l1", keep=1),
             TierSpec(name="L2", storage="shared", interval_steps=1, path=str(root / "l2"), keep=1))

    def factory(rank: int):
        def build():
            client = dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=60))
            return Generation(client, table, rank, backend="gloo", timeout_s=120, poll_ms=20,
                              interrupted=lambda: False, channel="ckpt/")
        return build

    engines = []
    for r, node in enumerate(nodes):
        eng = CheckpointEngine(specs, job_id="1", run_id="0" * 32, job_dir=str(root), node=node)
        eng.bind(rank=r, world_size=world, nodes=nodes, transfer=factory(r))
        engines.append(eng)
    states = [make_state(r, args.size_mb, args.tensors) for r in range(world)]

    def checkpoint(step: int, dedup: bool) -> dict:
        for eng in engines:
            eng.dedup_shared = dedup
        errors = []

        def work(r: int) -> None:
            try:
                engines[r].save(step, states[r], tiers=["L1", "L2"])
                assert engines[r].wait(600) and not engines[r].failures, engines[r].failures
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        l2 = [next(s for s in eng.stats if s["tier"] == "L2" and s["step"] == step) for eng in engines]
        path = layout.shard_path(str(root / "l2"), step, 0)
        t0 = time.perf_counter()  # rank 0's restore from L2, page cache warm for both modes
        assert not verify_rank_problems(path)
        read_rank_state(path)
        return {"step": step, "l2_bytes": int(sum(s["bytes"] for s in l2)),
                "l2_bytes_per_rank": [int(s["bytes"]) for s in l2],
                "l2_persist_s": max(s["seconds"] for s in l2),
                "l2_restore_rank0_s": time.perf_counter() - t0}

    runs: dict[str, list[dict]] = {"full": [], "dedup": []}
    step = 0
    try:
        for mode in ("full", "dedup"):  # warm-up, untimed
            step += 1
            checkpoint(step, mode == "dedup")
        for _ in range(args.repeat):
            for mode in ("full", "dedup"):
                step += 1
                runs[mode].append(checkpoint(step, mode == "dedup"))
    finally:
        for eng in engines:
            eng.close()
    out = {"ranks": world, "size_mb_per_rank": args.size_mb, "tensors": args.tensors, "repeat": args.repeat,
           "dir": str(root), "host": platform.node(), "torch": torch.__version__,
           "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "runs": runs}
    for mode, rs in runs.items():
        out[mode] = {k: stats([r[k] for r in rs]) for k in ("l2_bytes", "l2_persist_s", "l2_restore_rank0_s")}
    out["bytes_ratio_full_over_dedup"] = out["full"]["l2_bytes"]["median"] / out["dedup"]["l2_bytes"]["median"]
    out["persist_ratio_full_over_dedup"] = (out["full"]["l2_persist_s"]["median"]
                                            / out["dedup"]["l2_persist_s"]["median"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mb", type=float, default=64.0, help="replicated state per rank, MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5, help="timed checkpoints of each mode (interleaved)")
    ap.add_argument("--dir", default=None, help="where the tiers live (default: system temp)")
    ap.add_argument("--json", default="l2_dedup.json")
    args = ap.parse_args()
    r = run(args)
    Path(args.json).write_text(json.dumps(stamped(r, __file__), indent=1) + "\n")
    for mode in ("full", "dedup"):
        b, t = r[mode]["l2_bytes"], r[mode]["l2_persist_s"]
        print(f"{mode:>5}: L2 bytes/checkpoint median {b['median'] / 2**20:8.1f} MiB "
              f"(min {b['min'] / 2**20:.1f}, max {b['max'] / 2**20:.1f}); L2 persist median {t['median']:.3f} s "
              f"(min {t['min']:.3f}, max {t['max']:.3f}); rank 0 L2 verify+read median "
              f"{r[mode]['l2_restore_rank0_s']['median']:.3f} s")
    print(f"full/dedup: bytes x{r['bytes_ratio_full_over_dedup']:.2f}, persist time x{r['persist_ratio_full_over_dedup']:.2f}"
          f"  -> {args.json}")
    import shutil
    shutil.rmtree(r["dir"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
