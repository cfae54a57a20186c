#!/usr/bin/env python3
"""A recovery's small exchanges on a fresh group: gloo's all-reduce against the store.

N processes (``torch.multiprocessing``, one TCPStore) build one real ``Generation``
(gloo) per trial, the previous ones kept (parked, as after a fault), and time, from the
new group's construction on, what a peer restore does first: the gather of every rank's row of integers
(``Generation.all_gather_rows``), once through the store (the default up to
``reconnect.STORE_GATHER_MAX`` ranks) and once through gloo's all-reduce (the path above
it), alternating which goes first. Then a small state (an MLP's, a few KB) from rank
2 to rank 0 and 1, through ``restore.stream_state``: through the store, and through one
all-to-all. Each figure is the slowest rank's time (the exchange is done when the last
rank has it). Not a test; ``--json`` writes the figures.

    python3 benchmarks/small_exchange.py --ranks 4 8 --trials 7 --json docs/results/small-exchange.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from slurm_resilience.model import RankSlot, RankTable  # noqa: E402
from slurm_resilience.worker import reconnect, restore  # noqa: E402

COMMAND = "python3 benchmarks/small_exchange.py"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"step": 7, "objects": {"model": collections.OrderedDict(
        w1=torch.randn(64, 32, generator=g), b1=torch.randn(64, generator=g),
        w2=torch.randn(4, 64, generator=g), b2=torch.randn(4, generator=g))}}


def _rank(rank: int, world: int, port: int, trials: int, q) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    kept, out = [], collections.defaultdict(list)
    offers = [9 if r >= 2 else -1 for r in range(world)]  # ranks 0 and 1 receive (a replaced node's)
    sources = restore.assign_sources(offers)
    for trial in range(trials + 1):  # the first is a warm-up
        for path in (("store", "gloo") if trial % 2 else ("gloo", "store")):
            reconnect.STORE_GATHER_MAX = 64 if path == "store" else 0
            table = RankTable(generation=len(kept) + 1, slots=tuple(
                RankSlot(rank=r, node=f"n{r}", worker_id=f"w{r}") for r in range(world)))
            gen = reconnect.Generation(store, table, rank, backend="gloo", timeout_s=60.0, poll_ms=20,
                                       interrupted=lambda: False)
            kept.append(gen)  # parked, as a fault leaves the old group
            state = _state(1) if offers[rank] == 9 else None
            ready = restore.outgoing(state) if state is not None else None
            t0 = time.perf_counter()
            rows = gen.all_gather_rows([offers[rank], *(ready.meta if ready else (-1, -1, -1))])
            t1 = time.perf_counter()
            into = None if state is not None else {k: torch.zeros_like(v) for k, v in _flat(_state(0)).items()}
            got = restore.stream_state(gen, sources, state, into=into, ready=ready, metas=[r[1:] for r in rows])
            t2 = time.perf_counter()
            if trial:
                out[f"gather_{path}"].append(t1 - t0)
                out[f"state_{path}"].append(t2 - t1)
            if rank in sources and not torch.equal(got["objects"]["model"]["w1"], _state(1)["objects"]["model"]["w1"]):
                raise AssertionError(f"rank {rank}: the state differs ({path})")
    q.put((rank, dict(out)))


def _flat(state: dict) -> dict:
    from slurm_resilience.checkpoint.state_tree import flatten_state
    return flatten_state(state)[0]


def run(world: int, trials: int) -> dict:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, server.port, trials, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    res = {}
    for key in got[0]:
        slowest = [1e3 * max(got[r][key][i] for r in got) for i in range(trials)]
        res[key] = {"median_ms": round(statistics.median(slowest), 2), "min_ms": round(min(slowest), 2),
                    "max_ms": round(max(slowest), 2), "n": trials}
    for what in ("gather", "state"):
        res[f"{what}_ratio"] = round(res[f"{what}_gloo"]["median_ms"] / max(res[f"{what}_store"]["median_ms"], 1e-3), 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    out = {"generator": "benchmarks/small_exchange.py",
           "command": f"{COMMAND} --ranks {' '.join(map(str, args.ranks))} --trials {args.trials}"
                      + (f" --json {args.json}" if args.json else ""),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_at_start": list(os.getloadavg()), "torch": torch.__version__,
           "sizes": {}}
    for n in args.ranks:
        out["sizes"][str(n)] = run(n, args.trials)
        r = out["sizes"][str(n)]
        print(f"{n} ranks: gather store {r['gather_store']['median_ms']} ms, gloo all-reduce "
              f"{r['gather_gloo']['median_ms']} ms ({r['gather_ratio']}x); small state store "
              f"{r['state_store']['median_ms']} ms, all-to-all {r['state_gloo']['median_ms']} ms ({r['state_ratio']}x)",
              flush=True)
    out["load_at_end"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
