"""The parts of the worker session, each alone, and the facade in one process.

Pure parts (admission) and small adapters (event sink, parking lot, bounded wait)
use fakes or an in-process store; the facade runs a world of one against a real
TCPStore and a liveness socket standing in for the supervisor.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import types
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slurm_resilience import JobEnded
from slurm_resilience.errors import StepAborted
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.protocol import Plan, PlanAction, Role, StoreKey, WorkerEnv, WorkerEvent, write_token
from slurm_resilience.worker.event_sink import EventSink
from slurm_resilience.worker.membership import EXIT_ABORTED, EXIT_FENCED, Admission, Membership, admit
from slurm_resilience.worker.parking import ParkingLot
from slurm_resilience.worker.reconnect import Generation, wait_slice

pytestmark = pytest.mark.timeout(60)


def _table(g, *workers):
    return RankTable(generation=g, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=w)
                                               for i, w in enumerate(workers)))


def _plan(g, *workers, action=PlanAction.RUN, reason=""):
    return Plan(generation=g, action=action, table=_table(g, *workers), reason=reason)


def _store():
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)


def _events(store):
    n = int(store.add(StoreKey.EVENT_COUNTER.value, 0))
    return [json.loads(store.get(StoreKey.EVENT.of(i))) for i in range(1, n + 1)]


# -- JobEnded -----------------------------------------------------------------------
def test_job_ended_is_not_swallowed_by_except_exception():
    with pytest.raises(JobEnded) as info:
        try:
            raise JobEnded(EXIT_ABORTED, "aborted: no spare")
        except Exception:  # a training loop's catch-all must not end the job's ending
            pytest.fail("JobEnded was caught as an Exception")
    assert (info.value.code, info.value.reason) == (3, "aborted: no spare")
    assert not isinstance(info.value, SystemExit)
    assert EXIT_FENCED == 0 and EXIT_ABORTED == 3


# -- admission (pure) ------------------------------------------------------------------
@pytest.mark.parametrize("action,worker,role,joined,expected", [
    (PlanAction.ABORT, "w0", Role.RANK, True, Admission.ABORT),
    (PlanAction.STOP, "w0", Role.RANK, True, Admission.STOP),
    (PlanAction.RUN, "w0", Role.RANK, False, Admission.JOIN),
    (PlanAction.PERSIST, "w0", Role.RANK, True, Admission.JOIN),
    (PlanAction.RUN, "gone", Role.RANK, False, Admission.FENCED),
    (PlanAction.RUN, "spare", Role.STANDBY, False, Admission.WAIT),
    (PlanAction.RUN, "spare", Role.STANDBY, True, Admission.FENCED),  # adopted once, then left out
    (PlanAction.ABORT, "spare", Role.STANDBY, False, Admission.ABORT),
])
def test_admit(action, worker, role, joined, expected):
    assert admit(_plan(1, "w0", "w1", action=action), worker, role, joined) is expected


# -- event sink ------------------------------------------------------------------------
def test_event_sink_numbers_events_and_accepts_enum_or_string():
    store = _store()
    where = [(None, None)]
    sink = EventSink(store, worker_id="w0", node="n0", where=lambda: where[0])
    sink.emit(WorkerEvent.RECONNECTED, start=1.0)
    where[0] = (4, 2)
    sink.emit("checkpoint_saved", step=7)  # what the checkpoint engine sends
    evs = _events(store)
    assert [e["kind"] for e in evs] == ["reconnected", "checkpoint_saved"]
    assert (evs[0]["generation"], evs[0]["rank"]) == (None, None)
    assert (evs[1]["generation"], evs[1]["rank"], evs[1]["step"], evs[1]["worker_id"]) == (4, 2, 7, "w0")
    with pytest.raises(ValueError):
        sink.emit("no_such_event")


def test_event_sink_is_safe_from_two_threads():
    store = _store()
    sink = EventSink(store, worker_id="w0", node="n0", where=lambda: (0, 0))
    threads = [threading.Thread(target=lambda: [sink.emit(WorkerEvent.DONE, step=i) for i in range(20)])
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_events(store)) == 40


# -- parking lot -------------------------------------------------------------------------
class _Held:
    pass


def test_parking_lot_releases_only_after_the_hold():
    now = [100.0]
    lot = ParkingLot(hold_s=30.0, clock=lambda: now[0])
    a, b = _Held(), _Held()
    ra, rb = weakref.ref(a), weakref.ref(b)
    lot._stop.set()  # no background thread: this test drives release_expired itself
    lot.park(a)
    now[0] = 110.0
    lot.park(b)
    del a, b
    assert lot.release_expired() == 0 and len(lot) == 2
    now[0] = 130.0
    assert lot.release_expired() == 1
    gc.collect()
    assert ra() is None and rb() is not None
    now[0] = 140.0
    assert lot.release_expired() == 1 and len(lot) == 0
    gc.collect()
    assert rb() is None


def test_parking_lot_drops_from_its_own_thread_without_blocking_park():
    dropped_in = []

    class Slow:
        def __del__(self):  # a gloo group's destructor may block until its timeout
            dropped_in.append(threading.current_thread().name)
            time.sleep(0.3)

    lot = ParkingLot(hold_s=0.05, check_s=0.02)
    t0 = time.monotonic()
    lot.park(Slow())
    lot.park(Slow())
    # one blocking drop alone takes 0.3 s: park() returning sooner did not drop in place
    assert time.monotonic() - t0 < 0.3
    deadline = time.monotonic() + 30
    while (len(lot) or len(dropped_in) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    lot.close()
    assert len(dropped_in) == 2 and threading.main_thread().name not in dropped_in, dropped_in
    assert dropped_in == ["sr-parking", "sr-parking"]


def test_parking_lot_close_keeps_what_is_left():
    lot = ParkingLot(hold_s=60.0, check_s=0.01)
    lot.park(_Held())
    lot.close()
    assert len(lot) == 1  # dropping it at exit could block for the group timeout


# -- bounded wait: telling an expired slice from a failure ------------------------------------
class _Work:
    """A fake work: ``wait`` raises ``errors`` in turn, ``is_completed`` says ``done``."""

    def __init__(self, errors, done):
        self.errors, self.done, self.waits = list(errors), done, 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.errors:
            err = self.errors.pop(0)
            if err is not None:
                raise err
        return True

    def is_completed(self):
        return self.done


def test_wait_slice_finished():
    assert wait_slice(_Work([None], done=True), timedelta(milliseconds=1)) is True


def test_wait_slice_expired_slice_is_not_a_failure():
    assert wait_slice(_Work([RuntimeError("Operation timed out!")], done=False), timedelta(milliseconds=1)) is False


def test_wait_slice_failed_collective_raises_its_error():
    boom = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="closed by peer"):
        wait_slice(_Work([boom, boom], done=True), timedelta(milliseconds=1))


def test_wait_slice_completed_right_after_the_slice_expired():
    work = _Work([RuntimeError("Operation timed out!"), None], done=True)
    assert wait_slice(work, timedelta(milliseconds=1)) is True and work.waits == 2


def test_wait_slice_typed_backend_error_is_a_failure():
    with pytest.raises(dist.DistBackendError):
        wait_slice(_Work([dist.DistBackendError("watchdog")], done=False), timedelta(milliseconds=1))


def _pair(store, interrupted=lambda: False, timeout_s=5.0):
    """Two gloo ranks of one generation as threads of this process."""
    table = _table(0, "w0", "w1")
    gens = [None, None]

    def build(r):
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10))
        gens[r] = Generation(client, table, r, backend="gloo", timeout_s=timeout_s, poll_ms=20,
                             interrupted=interrupted)

    ts = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return gens


def test_real_gloo_wait_outlasts_many_slices_then_completes():
    """A late peer: rank 0's slices expire (plain RuntimeError in torch's gloo) and it keeps waiting."""
    server = _store()  # kept: a lazily built gloo group reads its peers' addresses at first use
    gens = _pair(server)
    out = {}

    def rank(r):
        if r == 1:
            time.sleep(0.3)  # 15 slices of 20 ms
        t = torch.full((4,), float(r + 1))
        out[r] = gens[r].all_reduce_sum(t)

    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert torch.equal(out[0], torch.full((4,), 3.0)) and torch.equal(out[1], out[0])


def test_real_gloo_wait_abandoned_when_a_newer_plan_appears():
    flag = threading.Event()
    server = _store()
    gens = _pair(server, interrupted=flag.is_set, timeout_s=2.0)
    threading.Timer(0.1, flag.set).start()
    t0 = time.monotonic()
    with pytest.raises(StepAborted, match="abandoned"):
        gens[0].all_reduce_sum(torch.ones(4))  # rank 1 never joins the collective
    assert time.monotonic() - t0 < 1.5  # well before the 2 s group timeout
    parked = gens[0].close()
    assert parked.pg is gens[0].pg and len(parked.works) == 1


# -- membership --------------------------------------------------------------------------------
class _Recorder:
    def __init__(self):
        from slurm_resilience.worker.progress_page import ProgressBoard

        self.events, self.bound, self.hb = [], [], {}
        self.progress = ProgressBoard(port=0)  # the real page the watchdog's pulse would read
        self.period_s = 0.25

    def emit(self, kind, **fields):
        self.events.append((WorkerEvent(kind), fields))

    def bind(self, **kw):
        self.bound.append(kw)

    def update(self, **kw):
        self.hb.update(kw)


def _env(worker_id, role=Role.RANK):
    return WorkerEnv(store_addr="127.0.0.1", store_port=0, liveness_port=0, token="t", job_dir="/nonexistent",
                     worker_id=worker_id, node="n0", role=role, generation=0, config_path="", job_id="1",
                     run_id="0" * 32)


def _membership(store, worker_id, role=Role.RANK, aborted=None):
    rec = _Recorder()
    cfg = types.SimpleNamespace(backend="gloo", pg_timeout_s=5.0, poll_interval_ms=5.0)

    def on_abort(plan):
        aborted.append(plan)
        raise JobEnded(EXIT_ABORTED, plan.reason)

    client = lambda: dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10))  # noqa: E731
    m = Membership(_env(worker_id, role), cfg, store, open_client=client, emit=rec.emit, heartbeat=rec,
                   checkpoints=rec, parking=ParkingLot(hold_s=5.0), progress=lambda: 11, on_abort=on_abort)
    return m, rec


def test_membership_fences_a_rank_left_out():
    store = _store()
    store.set(StoreKey.PLAN.of(0), _plan(0, "other").to_json())
    m, rec = _membership(store, "w0")
    with pytest.raises(JobEnded) as info:
        m.enter(0)
    assert info.value.code == EXIT_FENCED
    assert rec.events == [(WorkerEvent.FENCED, {"generation": 0})]


def test_membership_standby_waits_past_plans_without_it_then_stops():
    store = _store()
    store.set(StoreKey.PLAN.of(0), _plan(0, "w0").to_json())
    store.set(StoreKey.PLAN.of(1), _plan(1, "w0", action=PlanAction.STOP, reason="requeue").to_json())
    m, rec = _membership(store, "spare", Role.STANDBY)
    with pytest.raises(JobEnded) as info:
        m.enter(0)
    assert info.value.code == 0
    assert rec.events == [(WorkerEvent.STOPPED, {"step": 11, "reason": "requeue"})]


def test_membership_standby_ends_when_the_job_shuts_down():
    store = _store()
    threading.Timer(0.05, lambda: store.set(StoreKey.SHUTDOWN.value, "1")).start()
    m, rec = _membership(store, "spare", Role.STANDBY)
    with pytest.raises(JobEnded) as info:
        m.enter(0)
    assert info.value.code == 0 and rec.events == []


def test_membership_abort_goes_through_the_abort_hook():
    store = _store()
    store.set(StoreKey.PLAN.of(2), _plan(2, "w0", action=PlanAction.ABORT, reason="no spare").to_json())
    aborted = []
    m, _ = _membership(store, "w0", aborted=aborted)
    with pytest.raises(JobEnded) as info:
        m.enter(2)
    assert info.value.code == EXIT_ABORTED and [p.generation for p in aborted] == [2]


def test_membership_joins_a_world_of_one_and_parks_the_group_on_leave():
    store = _store()
    store.set(StoreKey.PLAN.of(0), _plan(0, "w0").to_json())
    m, rec = _membership(store, "w0")
    import torch
    import torch.distributed as dist

    plan = m.enter(0)
    assert plan.generation == 0 and m.group.world_size == 1 and m.where() == (0, 0)
    assert rec.bound[0]["rank"] == 0 and rec.hb == {"generation": 0, "rank": 0}
    # torch.distributed's default group is this generation's (the same backend object)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "sr_gloo"
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    parked = len(m._parking)
    assert [k for k, _ in rec.events] == [WorkerEvent.RECONNECTED]
    assert not m.newer_plan()
    store.set(StoreKey.PLAN.of(1), _plan(1, "w0").to_json())
    assert m.newer_plan()
    m.leave()
    # the group and the destroyed default group wrapping it are both parked
    assert m.group is None and m.where() == (0, None) and len(m._parking) == parked + 2
    assert not dist.is_initialized()
    m._parking.close()


def test_torchrun_environ_for_two_ranks_per_node():
    from slurm_resilience.supervisor.decide.ranktable import initial_table
    from slurm_resilience.worker.membership import torchrun_environ

    t = initial_table(["a", "b"], ["w0", "w1", "w2", "w3"], {"a": "1", "b": "2"}, device="cuda", tasks_per_node=2)
    assert torchrun_environ(t, 3) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                      "GROUP_RANK": "1", "SR_DEVICE": "cuda:1"}


def test_next_client_is_opened_ahead_once_and_taken_without_a_connect():
    from slurm_resilience.worker.membership import NextClient
    opened = []

    def open_client():
        opened.append(object())
        return opened[-1]

    nc = NextClient(open_client)
    first = nc.take()  # nothing ready: opened now
    assert first is opened[0] and len(opened) == 1
    nc.prepare()
    nc._filling.join(5)
    nc.prepare()  # one is ready: no second thread, no second connect
    assert nc._filling is None or not nc._filling.is_alive()
    assert len(opened) == 2
    assert nc.take() is opened[1] and len(opened) == 2  # taken without a connect
    assert nc.take() is opened[2]  # and the next one is opened at the join again


def test_next_client_that_fails_to_open_ahead_is_opened_at_the_join():
    import torch.distributed as dist
    from slurm_resilience.worker.membership import NextClient
    calls = []

    def open_client():
        calls.append(1)
        if len(calls) == 1:
            raise dist.DistNetworkError("connection refused")
        return "client"

    nc = NextClient(open_client)
    nc.prepare()
    nc._filling.join(5)
    assert nc.take() == "client" and len(calls) == 2


def test_membership_checkpoint_channel_removes_the_last_channel_keys_after_its_first_gather():
    """The checkpoint writer's per-generation group hands its last exchange's keys on: the
    next generation's channel removes them after its own first gather."""
    store = _store()
    store.set(StoreKey.PLAN.of(0), _plan(0, "w0").to_json())
    m, rec = _membership(store, "w0")
    m.enter(0)
    first = rec.bound[0]["transfer"]()
    assert first.all_gather_ints(5) == [5] and first.all_gather_ints(6) == [6]
    rows = dist.PrefixStore(StoreKey.PG_PREFIX.of(0) + "ckpt/", store)  # as the channel names its keys
    old = [StoreKey.GATHER_ROW.of(n, 0) for n in (1, 2)]
    assert not rows.check(old[:1]) and rows.check(old[1:])  # the first gather's row went at the second
    store.set(StoreKey.PLAN.of(1), _plan(1, "w0").to_json())
    m.leave()
    m.enter(1)
    second = rec.bound[1]["transfer"]()
    assert rows.check(old[1:])  # kept until the new channel's first gather
    assert second.all_gather_ints(7) == [7]
    assert not rows.check(old[1:])
    m._parking.close()
