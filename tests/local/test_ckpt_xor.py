"""XOR-protected L1 on localhost: real processes, real gloo transfer groups, per-node dirs.

A first set of rank processes writes checkpoints with ``redundancy: xor``; each
rank's node-local directory is ``ROOT/<node>/l1``. Then a node's directory is
deleted (the node is lost) or a shard is corrupted, a fresh set of processes
(a new generation) calls ``rebuild_missing()`` collectively and restores:

    one node lost per group   → its shard is rebuilt bit-identical into the rank
                                that holds the slot now (same or replacement node)
    two nodes of one group    → nothing rebuilt; the survivors still restore
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import verify_shard
from slurm_resilience.checkpoint.layout import parity_path
from slurm_resilience.checkpoint.xor_tier import read_parity

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
STEPS = (1, 2, 3)

_RANK = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from slurm_resilience.checkpoint.engine import CheckpointEngine
    from slurm_resilience.checkpoint.tiers import Redundancy, TierSpec
    from slurm_resilience.model import RankSlot, RankTable
    from slurm_resilience.worker.reconnect import Generation

    phase, root, port, rank, gen, nodes, group_size, round_bytes = sys.argv[1:9]
    rank, gen, port, group_size, nodes = int(rank), int(gen), int(port), int(group_size), nodes.split(",")
    if int(round_bytes):  # small column rounds: the multi-round paths run on small shards
        import slurm_resilience.checkpoint.xor_tier as xt
        xt.ROUND_BYTES = int(round_bytes)
        import slurm_resilience.checkpoint.xor_rebuild as xr
        xr.ROUND_BYTES = int(round_bytes)

    def state(step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        n = 3000 + 1500 * rank  # shards of different sizes in one group
        return {"objects": {"model": {"w": torch.rand(n, generator=g),
                                      "b": torch.rand(7, generator=g).to(torch.bfloat16)}},
                "step": step, "rank": rank}

    table = RankTable(generation=gen, slots=tuple(RankSlot(rank=i, node=n, worker_id=f"w{i}")
                                                 for i, n in enumerate(nodes)))
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    events = []
    specs = (TierSpec(name="L1", storage="local", interval_steps=1, redundancy=Redundancy.XOR,
                      group_size=group_size, path=root + "/{node}/l1", keep=2),)
    eng = CheckpointEngine(specs, job_id="1", run_id="0" * 32, job_dir=root, node=nodes[rank],
                           emit=lambda kind, **f: events.append([kind, f]))
    eng.bind(rank=rank, world_size=len(nodes), nodes=nodes,
             transfer=lambda: Generation(store, table, rank, backend="gloo", timeout_s=60, poll_ms=50,
                                         interrupted=lambda: False, channel="ckpt/"))
    out = {}
    if phase == "write":
        for step in (1, 2, 3):
            eng.save(step, state(step))
            assert eng.wait(120)
        out["failures"] = eng.failures
    else:
        out["rebuilt"] = eng.rebuild_missing()
        best = eng.best()
        out["best"] = best
        if best is not None:
            got = eng.load(best)
            want = state(best[0])
            out["equal"] = (got["rank"] == rank and got["step"] == best[0] and all(
                torch.equal(got["objects"]["model"][k], want["objects"]["model"][k]) and
                got["objects"]["model"][k].dtype == want["objects"]["model"][k].dtype for k in ("w", "b")))
    eng.close()
    out["events"] = events
    print("RESULT " + json.dumps(out, default=str), flush=True)
    # end as the toolkit's ranks do (exits.py): torch's C++ tear-down of the gloo group at
    # interpreter exit can abort ("terminate called without an active exception")
    from slurm_resilience.exits import exit_now
    exit_now(0)
    """
)


def _run_ranks(phase: str, root: Path, nodes: list[str], *, gen: int, group_size: int,
               round_bytes: int = 0) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, phase, str(root), str(store.port), str(r), str(gen),
                               ",".join(nodes), str(group_size), str(round_bytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for r in range(len(nodes))]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
            outs.append(json.loads(line[len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _l1(root: Path, node: str) -> str:
    return str(root / node / "l1")


def _write(root: Path, nodes: list[str], group_size: int, round_bytes: int = 0) -> dict[int, bytes]:
    """Write steps 1-3 on every rank; return each rank's newest shard bytes."""
    outs = _run_ranks("write", root, nodes, gen=0, group_size=group_size, round_bytes=round_bytes)
    assert all(o["failures"] == [] for o in outs), outs
    shards = {}
    for rank, node in enumerate(nodes):
        l1 = _l1(root, node)
        assert mf.complete_steps(l1) == [2, 3] and mf.read_latest(l1) == 3
        assert os.path.isfile(parity_path(l1, 3, rank))
        shards[rank] = Path(mf.shard_path(l1, 3, rank)).read_bytes()
    return shards


@pytest.mark.parametrize("replacement", [False, True])
def test_one_lost_node_per_group_is_rebuilt_bit_identical(tmp_path, replacement):
    # 5 ranks, group_size 3: groups [0, 1, 2] and [3, 4]; nodes n1 and n4 are lost.
    nodes = [f"n{i}" for i in range(5)]
    shards = _write(tmp_path, nodes, group_size=3, round_bytes=4096)
    old_parity = {r: read_parity(parity_path(_l1(tmp_path, nodes[r]), 3, r))[2].tobytes()
                  for r in (1, 4)}
    for lost in (1, 4):
        shutil.rmtree(tmp_path / nodes[lost])
    now = list(nodes)
    if replacement:  # spares take over the lost slots: fresh, empty node-local dirs
        now[1], now[4] = "spare1", "spare4"
    outs = _run_ranks("restore", tmp_path, now, gen=1, group_size=3, round_bytes=4096)

    for rank, out in enumerate(outs):
        assert sorted(map(tuple, out["rebuilt"])) == [(3, 1, True), (3, 4, True)], out
        l1 = _l1(tmp_path, now[rank])
        assert out["best"] == [3, "L1", mf.shard_path(l1, 3, rank)], out
        assert out["equal"] is True
        assert not [e for e in out["events"] if e[0] == "checkpoint_rebuild_failed"], out["events"]
    for lost in (1, 4):
        l1 = _l1(tmp_path, now[lost])
        path = mf.shard_path(l1, 3, lost)
        assert Path(path).read_bytes() == shards[lost]  # bit-identical
        assert verify_shard(path) == []
        assert mf.validate_step(l1, 3, deep=True) == []
        assert mf.read_latest(l1) == 3
        hdr, _, row = read_parity(parity_path(l1, 3, lost))
        assert row.tobytes() == old_parity[lost]  # the lost parity row is recomputed too
        assert mf.complete_steps(l1) == [3]  # only the newest step is rebuilt
    rebuilt_events = [e[1] for e in outs[0]["events"] if e[0] == "checkpoint_rebuilt"]
    assert rebuilt_events and rebuilt_events[0]["ranks"] == [1, 4]


def test_corrupt_shard_is_rebuilt(tmp_path):
    nodes = ["a", "b", "c", "d"]
    shards = _write(tmp_path, nodes, group_size=4)
    path = mf.shard_path(_l1(tmp_path, "c"), 3, 2)
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    assert verify_shard(path)
    outs = _run_ranks("restore", tmp_path, nodes, gen=1, group_size=4)
    assert [tuple(x) for x in outs[2]["rebuilt"]] == [(3, 2, True)]
    assert outs[2]["best"][:2] == [3, "L1"] and outs[2]["equal"] is True
    assert Path(path).read_bytes() == shards[2]


def test_two_lost_in_one_group_rebuild_nothing(tmp_path):
    nodes = ["a", "b", "c", "d"]
    _write(tmp_path, nodes, group_size=4)
    for node in ("b", "c"):
        shutil.rmtree(tmp_path / node)
    outs = _run_ranks("restore", tmp_path, nodes, gen=1, group_size=4)
    for rank, out in enumerate(outs):
        assert out["rebuilt"] == []
        plans = [e[1]["plan"] for e in out["events"] if e[0] == "checkpoint_rebuilt"]
        assert plans and "no step can be completed" in plans[0], out["events"]
        if rank in (1, 2):
            assert out["best"] is None
        else:
            assert out["best"][:2] == [3, "L1"] and out["equal"] is True
