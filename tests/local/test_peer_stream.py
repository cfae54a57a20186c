"""Peer restore streamed between real processes over gloo (``worker/restore.py``).

Three processes (torch.multiprocessing, one TCPStore, the real :class:`Generation`):
ranks at the newest step stream a few-MB state to the others in small chunks, and
each receiver ends with exactly the source's state — tensors bit for bit, non-tensor
leaves equal — received in place into its own tensors where they fit. A source that
stalls mid-transfer while a newer plan appears makes the receiver raise StepAborted.
"""

from __future__ import annotations

import collections
import pickle
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurm_resilience.errors import StepAborted
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.worker.reconnect import Generation
from slurm_resilience.worker.restore import assign_sources, outgoing, stream_state

from .spawned import run_ranks

pytestmark = pytest.mark.timeout(120)

CHUNK = 256 << 10  # 256 KiB chunks: a few MB state takes many rounds


def source_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    return {
        "step": 7,
        "objects": {
            "model": collections.OrderedDict(w=torch.randn(512, 1024, generator=g),  # 2 MiB
                                             b=torch.randn(1024, generator=g).double()),
            "optimizer": {"state": {0: {"exp_avg": torch.randn(300_001, generator=g),
                                        "step": torch.tensor(7.0)}},
                          "param_groups": [{"lr": 0.05, "params": [0]}]},
        },
        "bf16": torch.randn(70_001, generator=g).to(torch.bfloat16),
        "special": special, "ints": torch.arange(-3, 3), "bools": torch.tensor([True, False]),
        "empty": torch.empty(0, 3), "noncontig": torch.arange(12.0).view(3, 4).t(),
        "rng": torch.Generator().manual_seed(seed).get_state(), "np": np.arange(5), "meta": ("a", 1, None, [1.5, {"x": "y"}]),
    }


def receiver_state() -> dict:
    """What a fresh rank holds: the model at its initial values, no optimizer state yet."""
    return {"objects": {"model": collections.OrderedDict(w=torch.zeros(512, 1024), b=torch.zeros(1024).double())}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).contiguous().view(torch.uint8).tolist()
                == b.reshape(-1).contiguous().view(torch.uint8).tolist())
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Counting(Generation):
    """Counts the collectives (the gathers and the all-to-alls) this rank takes part in."""

    calls = collections.Counter()

    def all_gather_rows(self, *a, **kw):
        self.calls["gather"] += 1
        return super().all_gather_rows(*a, **kw)

    def all_to_all(self, *a, **kw):
        self.calls["all_to_all"] += 1
        return super().all_to_all(*a, **kw)


class _Stalling(Generation):
    """A source that stops taking part after two chunk rounds (a hung node) while a newer
    plan is published: every all-to-all after that never starts on this rank."""

    def __init__(self, *a, newer, **kw) -> None:
        super().__init__(*a, **kw)
        self._calls, self._newer = 0, newer

    def all_to_all(self, *a, **kw):
        self._calls += 1
        if self._calls > 3:  # the header, then two chunks
            self._newer.set()
            raise StepAborted("source stalled (test)")
        return super().all_to_all(*a, **kw)


def small_state(seed: int) -> dict:
    """A few KB (an MLP's weights and optimizer state): one round, under ``STORE_BYTES``."""
    g = torch.Generator().manual_seed(seed)
    return {"step": 7, "objects": {"model": collections.OrderedDict(w=torch.randn(32, 64, generator=g),
                                                                   b=torch.randn(64, generator=g).double())},
            "meta": ("a", 1, None)}


def _rank(rank: int, world: int, port: int, offers: list[int], mode: str, out: str, newer, done) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        table = RankTable(generation=1, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=f"w{i}", local_rank=0)
                                                     for i in range(world)))
        kw = dict(backend="gloo", timeout_s=60.0, poll_ms=20, interrupted=newer.is_set)
        sources = assign_sources(offers)
        at_best = offers[rank] == max(offers)
        gen = (_Stalling(store, table, rank, newer=newer, **kw) if mode == "stall" and at_best
               else _Counting(store, table, rank, **kw))
        make = small_state if mode == "small" else source_state
        mine = {"objects": {"model": collections.OrderedDict(w=torch.zeros(32, 64), b=torch.zeros(64).double())}} \
            if mode == "small" else receiver_state()
        into = {f"objects/objects/model/{k}": v for k, v in mine["objects"]["model"].items()}
        ptr = mine["objects"]["model"]["w"].data_ptr()
        state = make(100 + rank) if at_best else None
        ahead = {}
        if mode in ("ahead", "small"):  # the sources' side prepared and its meta gathered with the offers
            ready = outgoing(state, CHUNK) if at_best else None
            metas = gen.all_gather_rows(ready.meta if ready else [-1, -1, -1])
            ahead = {"ready": ready, "metas": metas}
        try:
            got = stream_state(gen, sources, state, into=None if at_best else into, chunk_bytes=CHUNK, **ahead)
        except StepAborted as exc:
            result = {"aborted": str(exc)}
        else:
            want = make(100 + sources.get(rank, rank))
            result = {"same": _same(got, want), "diff": [k for k in want if not _same(got.get(k), want[k])],
                      "in_place": got["objects"]["model"]["w"].data_ptr() == ptr,
                      "calls": dict(_Counting.calls)}
        with open(out, "wb") as f:
            pickle.dump(result, f)
        if not at_best:
            done.set()
        elif mode == "stall":  # a hung node: the process stays, its sockets stay open
            done.wait(60)
    except BaseException:
        with open(out, "wb") as f:
            pickle.dump({"error": traceback.format_exc()}, f)


def _run(tmp_path, offers, mode="ok") -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    newer, done = ctx.Event(), ctx.Event()
    outs = [str(tmp_path / f"r{r}.pkl") for r in range(len(offers))]
    return run_ranks(ctx, _rank, [(r, len(offers), store.port, offers, mode, outs[r], newer, done)
                                  for r in range(len(offers))], outs)


def test_two_sources_stream_to_their_receivers_exactly(tmp_path):
    # ranks 1 and 2 hold step 9; rank 0 (stale survivor) and rank 3 (fresh) receive,
    # each from a different source (round-robin)
    offers = [4, 9, 9, -1]
    assert assign_sources(offers) == {0: 1, 3: 2}
    res = _run(tmp_path, offers)
    for r in (0, 3):
        assert res[r]["same"] and res[r]["in_place"], res[r]
    assert res[1]["same"] and res[2]["same"]  # sources keep their own state


def test_with_the_sources_meta_gathered_ahead_the_transfer_is_its_chunk_rounds_alone(tmp_path):
    """As the state sync does: each source's header length, rounds and first chunk's
    length travel with the offers (here: one gather before the transfer); the transfer
    is then one all-to-all per chunk, the header riding with the first, and no gather of
    its own. Without them: the same rounds after one gather of its own. Same bytes."""
    offers = [4, 9, 9, -1]
    rounds = outgoing(source_state(1), CHUNK).meta[1]
    assert rounds > 1
    for mode in ("ahead", "ok"):
        res = _run(tmp_path, offers, mode=mode)
        for r in (0, 3):
            assert res[r]["same"] and res[r]["in_place"], res[r]
        assert res[1]["same"] and res[2]["same"]
        for r in range(4):
            assert res[r]["calls"] == {"gather": 1, "all_to_all": rounds}, (mode, r, res[r])


def test_stalled_source_and_newer_plan_abort_the_transfer(tmp_path):
    res = _run(tmp_path, [9, -1], mode="stall")
    assert "stalled" in res[0]["aborted"]
    # the receiver saw the newer plan: in its wait, or before its next round started
    assert "a new generation was published" in res[1]["aborted"], res[1]


def test_a_small_state_in_a_small_world_moves_through_the_store_with_no_all_to_all(tmp_path):
    """Under ``STORE_BYTES`` and in a world of at most ``STORE_GATHER_MAX`` ranks, each
    source sets its bytes once and each receiver gets its source's: the same exact state,
    received in place, and no all-to-all on any rank (rank 3 neither sends nor receives)."""
    offers = [4, 9, 9, 9, -1]
    assert assign_sources(offers) == {0: 1, 4: 2}
    res = _run(tmp_path, offers, mode="small")
    for r in (0, 4):
        assert res[r]["same"] and res[r]["in_place"], res[r]
    for r in range(5):
        assert res[r]["calls"] == {"gather": 1}, (r, res[r])
