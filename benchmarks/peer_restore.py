#!/usr/bin/env python3
"""Peer restore of a large state: the old whole-state broadcast vs the chunked stream.

Two fresh processes per trial, rank 0 the source (holds the state), rank 1 the
receiver (a warm standby: holds tensors of the same shapes, as a survivor or a
spare that loaded the model does). They join one gloo group (the real
``Generation``), meet at a barrier, and rank 1 times the restore until its own
tensors hold the source's values:

* ``before``: the previous ``worker/restore.py`` (kept here only): ``torch.save``
  into one byte tensor, broadcast the size and the bytes, ``torch.load``, then copy
  into its tensors (``load_state_dict``);
* ``after``: ``restore.stream_state`` with the default chunk size, received in place.

Each process reports its VmHWM (RSS high-water, /proc/self/status) and its RSS once
the state is built, so the restore's own memory is ``hwm - base``. Contenders
alternate within the run, after one warm-up trial each. Not a test; --json writes
the figures.

    python3 benchmarks/peer_restore.py --gib 2 --repeats 3 --json /tmp/peer_restore.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_resilience.worker.restore import CHUNK_BYTES  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402

TENSOR_MIB = 128


def _state(gib: float, fill: bool):
    import torch
    n = max(1, int(gib * 1024 / TENSOR_MIB))
    numel = TENSOR_MIB * (1 << 20) // 4
    model = {f"layer{i}.weight": (torch.arange(numel, dtype=torch.float32).add_(i) if fill else torch.zeros(numel))
             for i in range(n)}
    return {"step": 9, "objects": {"model": model}, "extras": {"note": "x" * 100}}


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))  # KiB


# -- the old restore, kept here only as the "before" contender ----------------------
def _old_broadcast_state(gen, state, source):
    import torch
    if gen.rank == source:
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    else:
        payload = None
    size = torch.tensor([payload.numel() if payload is not None else 0])
    gen.broadcast(size, source)
    data = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    gen.broadcast(data, source)
    if gen.rank == source:
        return state
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from slurm_resilience.checkpoint.state_tree import flatten_state
    from slurm_resilience.model import RankSlot, RankTable
    from slurm_resilience.worker.reconnect import Generation
    from slurm_resilience.worker.restore import assign_sources, stream_state

    torch.set_num_threads(1)
    state = _state(args.gib, fill=args.rank == 0)
    base = _vm("VmRSS")
    store = dist.TCPStore("127.0.0.1", args.port, None, False, timedelta(seconds=60))
    table = RankTable(generation=1, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=f"w{i}", local_rank=0)
                                                 for i in range(2)))
    gen = Generation(store, table, args.rank, backend="gloo", timeout_s=600, poll_ms=50, interrupted=lambda: False)
    gen.barrier()
    t0 = time.perf_counter()
    if args.contender == "before":
        got = _old_broadcast_state(gen, state if args.rank == 0 else None, 0)
        if args.rank == 1:  # load_state_dict: copy into the tensors this rank holds
            for k, t in state["objects"]["model"].items():
                t.copy_(got["objects"]["model"][k])
            del got
    else:
        into = flatten_state(state)[0] if args.rank == 1 else None
        got = stream_state(gen, assign_sources([9, -1]), state if args.rank == 0 else None, into=into)
        if args.rank == 1:
            for k, t in state["objects"]["model"].items():
                t.copy_(got["objects"]["model"][k])  # in place already: a copy onto itself
            del got
    seconds = time.perf_counter() - t0
    ok = True
    if args.rank == 1:
        for i, t in enumerate(state["objects"]["model"].values()):
            ok &= bool(t[:: 1 << 16].eq(torch.arange(t.numel(), dtype=torch.float32)[:: 1 << 16].add_(i)).all())
    gen.barrier()
    print(json.dumps({"rank": args.rank, "seconds": seconds, "hwm_kib": _vm("VmHWM"), "base_kib": base,
                      "ok": ok}), flush=True)
    os._exit(0)


def trial(contender: str, gib: float) -> dict:
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--port", str(store.port),
                               "--contender", contender, "--gib", str(gib)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    out = {}
    for r, p in enumerate(procs):
        text, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"{contender} rank {r} exited {p.returncode}")
        out[r] = json.loads(text.strip().splitlines()[-1])
    if not out[1]["ok"]:
        raise SystemExit(f"{contender}: the receiver's state differs from the source's")
    mib = lambda k: round(k / 1024, 1)  # noqa: E731
    return {"seconds": out[1]["seconds"],
            "receiver_hwm_mib": mib(out[1]["hwm_kib"]), "receiver_extra_mib": mib(out[1]["hwm_kib"] - out[1]["base_kib"]),
            "source_hwm_mib": mib(out[0]["hwm_kib"]), "source_extra_mib": mib(out[0]["hwm_kib"] - out[0]["base_kib"])}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0, help="state size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--contender", default="after", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    contenders = ("before", "after")
    for c in contenders:
        trial(c, args.gib)  # warm-up, not counted
    runs = {c: [] for c in contenders}
    for _ in range(args.repeats):
        for c in contenders:
            runs[c].append(trial(c, args.gib))
    keys = runs["before"][0].keys()
    res = {c: {k: summary([r[k] for r in runs[c]]) for k in keys} for c in contenders}
    ratios = {k: res["before"][k]["median"] / res["after"][k]["median"] for k in keys if res["after"][k]["median"]}
    report = {"state_gib": args.gib, "repeats": args.repeats, "chunk_mib": CHUNK_BYTES >> 20, "host": platform.node(),
              "cpus": os.cpu_count(), "results": res, "before_over_after": ratios}
    for c in contenders:
        print(c, {k: round(v["median"], 2) for k, v in res[c].items()})
    print("before/after (median):", {k: round(v, 2) for k, v in ratios.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(stamped(report, __file__), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
