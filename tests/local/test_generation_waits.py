"""A generation's waits (``worker/reconnect.Generation``): small gathers through the
store, and a collective not started once a newer plan is out.

Real processes, one TCPStore, the real :class:`Generation` (gloo): in a world of at most
``STORE_GATHER_MAX`` ranks a gather of integer rows is each rank's ``set`` and one
``multi_get`` (no collective runs on the group), and gives what the all-reduce gives;
above it the all-reduce runs. A rank that never arrives while a newer plan is published
makes the others give up with StepAborted, as a collective's wait does. A gloo group
built lazily (``reconnect.gloo_lazy_init``) forms without waiting for every rank, reduces
like a full-mesh one, and a rank missing from it holds only the first collective (until
a newer plan or the group's timeout).
"""

from __future__ import annotations

import os
import pickle
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurm_resilience.errors import StepAborted
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.worker import reconnect
from slurm_resilience.worker.reconnect import Generation

from .spawned import run_ranks

pytestmark = pytest.mark.timeout(120)


class _Counting(Generation):
    """Counts the all-reduces this rank takes part in (a store gather runs none)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.all_reduces = 0

    def all_reduce_sum(self, tensor):
        self.all_reduces += 1
        return super().all_reduce_sum(tensor)


def _rank(rank: int, world: int, port: int, limit: int, mode: str, out: str, newer) -> None:
    try:
        reconnect.STORE_GATHER_MAX = limit
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        table = RankTable(generation=1, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=f"w{i}")
                                                     for i in range(world)))
        gen = _Counting(store, table, rank, backend="gloo", timeout_s=60.0, poll_ms=20, interrupted=newer.is_set)
        result: dict = {}
        if mode == "absent":  # the last rank joined the group, then never gathers (a hung node)
            if rank == world - 1:
                newer.set()  # the supervisor publishes the next plan
                result["skipped"] = True
            else:
                try:
                    gen.all_gather_rows([rank])
                    result["aborted"] = ""
                except StepAborted as exc:
                    result["aborted"] = str(exc)
        else:
            first = gen.all_gather_rows([rank, 10 * rank, -rank])
            second = gen.all_gather_ints(100 + rank)  # a second gather of the same generation
            result = {"first": first, "second": second, "all_reduces": gen.all_reduces}
            if limit >= world:  # through the store: what is left there
                rows = dist.PrefixStore(reconnect.StoreKey.PG_PREFIX.of(1), store)
                gen.barrier()  # every rank has removed what its second gather freed
                result["after_3"] = [rows.check([f"rows/{n}/{r}"]) for n in (1, 3) for r in range(world)]
                table2 = RankTable(generation=2, slots=table.slots)
                gen2 = _Counting(store, table2, rank, backend="gloo", timeout_s=60.0, poll_ms=20,
                                 interrupted=newer.is_set, stale=gen.leftovers())
                gen2.barrier()  # removes generation 1's last rows
                gen2.barrier()  # every rank has
                result["gen1_left"] = [rows.check([f"rows/{n}/{r}"]) for n in (1, 2, 3) for r in range(world)]
        with open(out, "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(out, "wb") as f:
            pickle.dump({"error": traceback.format_exc()}, f)


def _run(tmp_path, world: int, limit: int, mode: str = "ok") -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    newer = ctx.Event()
    outs = [str(tmp_path / f"{mode}-{limit}-r{r}.pkl") for r in range(world)]
    return run_ranks(ctx, _rank, [(r, world, store.port, limit, mode, outs[r], newer) for r in range(world)], outs)


@pytest.mark.parametrize("limit,all_reduces", [(64, 0), (1, 2)])
def test_a_small_world_gathers_through_the_store_and_gets_what_the_all_reduce_gets(tmp_path, limit, all_reduces):
    """limit 64: three ranks gather through the store (no all-reduce); limit 1: the
    all-reduce, as a world above the limit does. The rows are the same either way."""
    world = 3
    for res in _run(tmp_path, world, limit):
        assert res["first"] == [[r, 10 * r, -r] for r in range(world)]
        assert res["second"] == [100 + r for r in range(world)]
        assert res["all_reduces"] == all_reduces, res
        if limit >= world:
            # Each rank removes its keys of a gather once the next one has completed (every
            # rank read them); the next generation removes the last ones after its first.
            assert res["after_3"] == [False] * world + [True] * world
            assert res["gen1_left"] == [False] * (3 * world)


def test_a_rank_that_never_gathers_and_a_newer_plan_abort_the_others(tmp_path):
    res = _run(tmp_path, 3, 64, mode="absent")
    assert res[2] == {"skipped": True}
    for r in (0, 1):
        assert "abandoned" in res[r]["aborted"], res[r]


def test_a_collective_is_not_started_once_a_newer_plan_is_out(tmp_path):
    """A rank that comes out of its compute after the next plan was published aborts its
    step at once, instead of starting the all-reduce and waiting out a poll slice."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    table = RankTable(generation=1, slots=(RankSlot(rank=0, node="n0", worker_id="w0"),))
    newer = {"out": False}
    gen = _Counting(store, table, 0, backend="gloo", timeout_s=60.0, poll_ms=20, interrupted=lambda: newer["out"])
    t = torch.ones(3)
    gen.all_reduce_sum(t)  # no newer plan: it runs
    assert t.tolist() == [1.0, 1.0, 1.0]
    newer["out"] = True
    started = []
    with pytest.raises(StepAborted, match="not started"):
        gen._run(lambda: started.append(1) or gen.pg.allreduce([t]), "allreduce", t)
    assert started == []


def _lazy_rank(rank: int, world: int, port: int, out: str, built, timeout_s: float) -> None:
    """A rank of a gloo group built with ``reconnect.gloo_lazy_init`` (the default)."""
    try:
        reconnect.set_gloo_interface(None, lazy_init=True)
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        table = RankTable(generation=1, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=f"w{i}")
                                                     for i in range(world)))
        gen = Generation(store, table, rank, backend="gloo", timeout_s=timeout_s, poll_ms=20,
                         interrupted=lambda: False)
        built.put(rank)
        t = torch.full((3,), float(rank + 1))
        try:
            gen.all_reduce_sum(t)
            result = {"sum": t.tolist()}
        except StepAborted as exc:
            result = {"aborted": str(exc)}
        with open(out, "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(out, "wb") as f:
            pickle.dump({"error": traceback.format_exc()}, f)
    os._exit(0)  # a group with a pending collective would hold the exit until its timeout


def _run_lazy(tmp_path, world: int, present: int, timeout_s: float) -> list[dict]:
    """``present`` of the ``world`` ranks start, each with ``timeout_s`` as its group's
    timeout (``reconnect.pg_timeout_s``)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    built = ctx.Queue()
    outs = [str(tmp_path / f"lazy-{world}-{present}-r{r}.pkl") for r in range(present)]

    def all_built() -> None:
        # A full-mesh group would hold every constructor until the missing rank came
        # (or the 60 s timeout): here each returns without it.
        assert sorted(built.get(timeout=45) for _ in range(present)) == list(range(present))

    return run_ranks(ctx, _lazy_rank, [(r, world, store.port, outs[r], built, timeout_s) for r in range(present)],
                     outs, started=all_built, join_s=60)


def test_a_lazy_gloo_group_reduces_like_a_full_mesh_one(tmp_path):
    for res in _run_lazy(tmp_path, world=3, present=3, timeout_s=60.0):
        assert res == {"sum": [6.0, 6.0, 6.0]}


def test_a_lazy_gloo_group_forms_without_a_missing_rank_whose_first_collective_waits_for_it(tmp_path):
    """Rank 3 never starts (its node died before the group formed): the other three have
    their group at once; their all-reduce waits on rank 3 until the group's timeout, in
    slices (a newer plan would end it sooner: the tests above)."""
    res = _run_lazy(tmp_path, world=4, present=3, timeout_s=3.0)
    for r in range(3):
        # gloo's own connect to rank 3 gives up at the same timeout ("allreduce failed: wait
        # timeout ... keys: .../3"), or the bounded wait does ("did not complete within").
        assert res[r].get("aborted", "").startswith(("allreduce failed", "allreduce did not complete")), res[r]
