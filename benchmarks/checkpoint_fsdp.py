#!/usr/bin/env python3
"""FSDP2 checkpoint benchmark: the toolkit's engine vs DCP ``save`` / ``async_save``, like for like.

``--world`` ranks (torch.multiprocessing, gloo, CPU) shard the transformer of
examples/train_fsdp.py (sized by --dim/--layers/--vocab) with ``fully_shard`` per block
and on the root, built through the toolkit's FSDP2 wrapper (``worker/fsdp.py``, what
``session.fsdp(build)`` returns), take one AdamW step (so the optimizer state exists)
and then checkpoint that same state with every contender:

* ``ours``: the model and optimizer state exactly as the session saves them (nested
  sharded objects, ``RebuiltFSDP.state_of``: ``get_model_state_dict`` /
  ``get_optimizer_state_dict`` with each DTensor's local shard flattened), saved by a
  ``CheckpointEngine`` per rank with L0 (memory) and L1 (node-local HDF5, committed
  collectively); stall = ``save`` returns, persist = L1 durable and committed (``wait``);
* ``dcp_save``: ``dcp.save(get_state_dict(...))``: stall = persist = the call;
* ``dcp_async``: ``dcp.async_save``: stall = the call, persist = its future's result.

DCP writes with ``FileSystemWriter(thread_count=)`` set to ours' I/O threads
(``shard_io.IO_THREADS``, in the JSON as ``threads``); its reader has no thread count.

Each timed span starts at the state extraction, includes it for every contender, and
is the slowest rank's (the job is blocked, or durable, when its slowest rank is).
Restore ends with the state in the live model and optimizer for both: ``ours`` reads
the L1 shard and loads it the way a recovery does (``pending`` + ``rebuild``:
``set_model_state_dict`` / ``set_optimizer_state_dict``); ``dcp`` is ``get_state_dict``
-> ``dcp.load`` of the ``dcp.save`` checkpoint -> ``set_state_dict``. Before each read
the live shards are zeroed, after it they are checked equal to the saved ones. Every
contender gets the same untimed warm-up (a write and a read), then --repeat rounds
interleaved (ours, dcp_save, dcp_async, ours, ...), with ``sync`` before every write
and the page cache dropped before every read when /proc/sys/vm/drop_caches is writable
(else warm). Medians, min, max, ratios; --json.

    python3 benchmarks/checkpoint_fsdp.py --world 4 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from checkpoint import drop_caches  # noqa: E402
from figures import run_and_write, stats  # noqa: E402
from slurm_resilience.checkpoint.shard_io import IO_THREADS  # noqa: E402

WRITERS = ("ours", "dcp_save", "dcp_async")
# (label, numerator, denominator): ratio = numerator / denominator, > 1: ours is faster
RATIOS = [
    ("stall: DCP save / ours", "dcp_save_stall", "ours_stall"),
    ("stall: DCP async_save / ours", "dcp_async_stall", "ours_stall"),
    ("persist: DCP save / ours", "dcp_save_persist", "ours_persist"),
    ("persist: DCP async_save / ours", "dcp_async_persist", "ours_persist"),
    ("restore: DCP load / ours", "dcp_restore", "ours_restore"),
]


# -- the state ------------------------------------------------------------------------
def build(args):
    """The toolkit's FSDP2 wrapper (what ``session.fsdp(build)`` returns) on this world's
    1-D mesh, after one AdamW step (so the optimizer state exists)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from train_fsdp import Transformer

    from slurm_resilience.worker.fsdp import RebuiltFSDP
    from slurm_resilience.worker.rebind import GenerationHooks

    def make(mesh):
        model = Transformer(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    f = RebuiltFSDP(make, mesh=lambda: mesh, generation=lambda: 0, world_size=dist.get_world_size,
                    hooks=GenerationHooks(), park=lambda old: None)
    tokens = torch.randint(args.vocab, (2, args.seq + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = torch.nn.functional.cross_entropy(f.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    f.optimizer.step()
    return f


def leaves(sd: dict, path=()):
    """(path, local tensor) of every DTensor leaf of a state dict."""
    from torch.distributed.tensor import DTensor

    for k, v in sd.items():
        if isinstance(v, dict):
            yield from leaves(v, (*path, str(k)))
        elif isinstance(v, DTensor):
            yield "/".join((*path, str(k))), v.to_local()


def live_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optimizer": o}


def put_state(model, opt, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


# -- contenders (one per rank process) --------------------------------------------------
class _Transfer:
    """The engine's transfer group on a gloo group of its own: what an L1 commit calls of
    ``worker.reconnect.Generation`` (no fault handling: nothing fails here)."""

    def __init__(self, pg) -> None:
        self.pg, self.rank, self.world_size = pg, dist.get_rank(), dist.get_world_size()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.pg)
        return t

    def all_gather_ints(self, value: int) -> list[int]:
        buf = torch.zeros(self.world_size, dtype=torch.int64)
        buf[self.rank] = value
        return [int(v) for v in self.all_reduce_sum(buf).tolist()]

    def barrier(self) -> None:
        self.all_gather_ints(1)


class Ours:
    def __init__(self, root: Path) -> None:
        from slurm_resilience.checkpoint.engine import CheckpointEngine
        from slurm_resilience.checkpoint.tiers import TierSpec

        rank, world = dist.get_rank(), dist.get_world_size()
        specs = (TierSpec(name="L0", storage="memory", interval_steps=1),
                 TierSpec(name="L1", storage="local", interval_steps=1, path=str(root / "ours" / "{node}"), keep=1))
        self.eng = CheckpointEngine(specs, job_id="bench", run_id="0" * 32, job_dir=str(root), node=f"n{rank}")
        transfer = _Transfer(dist.new_group(backend="gloo"))
        self.eng.bind(rank=rank, world_size=world, nodes=[f"n{r}" for r in range(world)], transfer=lambda: transfer)
        self.last: tuple[int, str, str] | None = None

    def write(self, i: int, f) -> tuple[float, float]:
        t0 = time.perf_counter()
        state = {part: f.state_of(part) for part in ("model", "optimizer")}  # what the session saves
        self.eng.save(i, state)
        stall = time.perf_counter() - t0
        if not self.eng.wait(timeout=600) or self.eng.failures:
            raise RuntimeError(f"ours: L1 write of round {i} not durable: {self.eng.failures}")
        self.last = next(c for c in self.eng.candidates() if c[1] == "L1" and c[0] == i)
        return stall, time.perf_counter() - t0

    def read(self, f) -> None:
        got = self.eng.load(self.last)
        f.pending = {part: got[part] for part in ("model", "optimizer")}  # as a restore hands it over
        f.rebuild()  # same generation: no new objects, the state is loaded (set_*_state_dict)

    def close(self) -> None:
        self.eng.close()


class DCPSave:
    asynchronous = False

    def __init__(self, root: Path) -> None:
        self.root, self.last = root, None

    def write(self, i: int, f) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp

        d = self.root / f"{type(self).__name__}-{i}"
        t0 = time.perf_counter()
        sd = live_state(f.model, f.optimizer)
        # the writer's threads, as ours (shard_io.IO_THREADS; FileSystemWriter's default is 1)
        writer = dcp.FileSystemWriter(str(d), thread_count=IO_THREADS)
        if self.asynchronous:
            fut = dcp.async_save(sd, storage_writer=writer)
            stall = time.perf_counter() - t0
            fut.result()
        else:
            dcp.save(sd, storage_writer=writer)
            stall = time.perf_counter() - t0
        persist = time.perf_counter() - t0
        dist.barrier()
        if dist.get_rank() == 0 and self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = d
        return stall, persist

    def read(self, f) -> None:
        import torch.distributed.checkpoint as dcp

        sd = live_state(f.model, f.optimizer)
        dcp.load(sd, checkpoint_id=str(self.last))
        put_state(f.model, f.optimizer, sd)

    def close(self) -> None:
        pass


class DCPAsync(DCPSave):
    asynchronous = True


# -- one rank ------------------------------------------------------------------------
def _slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _zero(f) -> None:
    sd = live_state(f.model, f.optimizer)
    for part in sd.values():
        for _, local in leaves(part):
            local.zero_()
    put_state(f.model, f.optimizer, sd)


def _check(f, want: dict[str, torch.Tensor], who: str) -> None:
    sd = live_state(f.model, f.optimizer)
    got = {f"{p}/{k}": t for p, part in sd.items() for k, t in leaves(part)}
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    if bad or set(got) != set(want):
        raise RuntimeError(f"{who}: restored state differs ({bad[:3]}, keys {set(got) ^ set(want)})")


def rank_main(rank: int, args, port: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    f = build(args)
    sd = live_state(f.model, f.optimizer)
    want = {f"{p}/{k}": t.clone() for p, part in sd.items() for k, t in leaves(part)}
    nbytes = sum(t.numel() * t.element_size() for t in want.values())
    total = torch.tensor([nbytes], dtype=torch.float64)
    dist.all_reduce(total)
    contenders = {"ours": Ours(Path(root)), "dcp_save": DCPSave(Path(root)), "dcp_async": DCPAsync(Path(root))}
    readers = {"ours": contenders["ours"], "dcp": contenders["dcp_save"]}
    cold = False

    def sync_and_maybe_drop() -> bool:
        dist.barrier()
        ok = drop_caches() if rank == 0 else False
        dist.barrier()
        return ok

    times: dict[str, list[float]] = {}
    try:
        for i in range(args.repeat + 1):  # round 0: the untimed warm-up of every contender
            for name, c in contenders.items():
                sync_and_maybe_drop()
                stall, persist = c.write(i, f)
                stall, persist = _slowest(stall), _slowest(persist)
                if i:
                    times.setdefault(f"{name}_stall", []).append(stall)
                    times.setdefault(f"{name}_persist", []).append(persist)
            for name, c in readers.items():
                _zero(f)
                cold = sync_and_maybe_drop()
                t0 = time.perf_counter()
                c.read(f)
                took = _slowest(time.perf_counter() - t0)
                _check(f, want, name)
                if i:
                    times.setdefault(f"{name}_restore", []).append(took)
    finally:
        for c in contenders.values():
            c.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "bytes": float(total), "cold": cold,
                                         "keys": len(want)}))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> dict:
    root = tempfile.mkdtemp(prefix="ckbench-fsdp-", dir=args.dir)
    out = os.path.join(root, "result.json")
    try:
        mp.spawn(rank_main, args=(args, _free_port(), root, out), nprocs=args.world, join=True)
        raw = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {k: stats(v) for k, v in raw["times"].items()}
    ratios = {}
    for label, num, den in RATIOS:
        per_run = [a / b for a, b in zip(figures[num]["runs"], figures[den]["runs"])]
        ratios[label] = {"median": figures[num]["median_s"] / figures[den]["median_s"], "per_run": per_run,
                         "min": min(per_run), "max": max(per_run)}
    return {"benchmark": "checkpoint_fsdp", "bytes": raw["bytes"], "sharded_tensors_per_rank": raw["keys"],
            "world": args.world, "repeat": args.repeat, "torch": torch.__version__,
            "threads": {"ours": IO_THREADS, "dcp_save": IO_THREADS, "dcp_async": IO_THREADS, "dcp_load": 1},
            "reads": "cold (page cache dropped)" if raw["cold"] else "warm (page cache not droppable)",
            "state": "ours: session.fsdp's own state (RebuiltFSDP.state_of / its load); DCP: get_state_dict",
            "figures": figures, "ratios": ratios}


LABELS = {"ours_stall": "ours: stall (save returns)", "dcp_save_stall": "DCP save: stall (= persist)",
          "dcp_async_stall": "DCP async_save: stall (call returns)",
          "ours_persist": "ours: persist (L1 durable, committed)", "dcp_save_persist": "DCP save: persist",
          "dcp_async_persist": "DCP async_save: persist (future done)",
          "ours_restore": "ours: restore (L1 read -> set_state_dict)",
          "dcp_restore": "DCP: restore (dcp.load -> set_state_dict)"}


def report(r: dict) -> str:
    gb = r["bytes"] / 1e9
    lines = [f"FSDP2 state: {gb:.3f} GB over {r['world']} ranks (torch {r['torch']}); {r['repeat']} interleaved "
             f"rounds after one warm-up each; reads {r['reads']}; slowest rank per round",
             f"{'what':<46}{'median s':>10}{'min':>8}{'max':>8}{'GB/s':>8}"]
    for key, label in LABELS.items():
        f = r["figures"][key]
        lines.append(f"{label:<46}{f['median_s']:>10.3f}{f['min_s']:>8.3f}{f['max_s']:>8.3f}{gb / f['median_s']:>8.2f}")
    lines.append(f"{'ratio (> 1: ours faster)':<46}{'median':>10}{'min':>8}{'max':>8}")
    for label, x in r["ratios"].items():
        lines.append(f"{label:<46}{x['median']:>10.2f}{x['min']:>8.2f}{x['max']:>8.2f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="ranks (processes, gloo on CPU)")
    ap.add_argument("--dim", type=int, default=640)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds of every contender (interleaved)")
    ap.add_argument("--dir", default=None, help="where to write (default: system temp)")
    ap.add_argument("--json", default="checkpoint_fsdp.json", help="write every figure here (default: %(default)s)")
    args = ap.parse_args()
    if args.repeat < 1 or args.world < 1:
        ap.error("--repeat and --world must be >= 1")
    if args.dim % args.heads:
        ap.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    return run_and_write(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
