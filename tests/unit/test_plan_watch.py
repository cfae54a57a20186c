"""Plan notices: the pure rule (worker/plan_watch.look), the pulse's fold of the
supervisor's messages (notices.Told), and PlanWatch over a real page."""

import time

import pytest

from slurm_resilience.protocol import StoreKey
from slurm_resilience.worker import notices, pulse
from slurm_resilience.worker.plan_watch import STORE_FALLBACK_S, Look, PlanWatch, look
from slurm_resilience.worker.progress_page import ProgressBoard

P = 0.25  # heartbeat period


@pytest.mark.parametrize("told, ended, relayed_age, asked_age, want", [
    (4, False, 0.1, 0.0, Look.OUT),          # told of this plan: out, no store call
    (5, True, 9.0, 9.0, Look.OUT),           # told of a newer one: out
    (3, True, 0.1, 0.0, Look.ENDED),         # the job is over
    (3, False, 0.1, 0.5, Look.WAIT),         # the pulse relays and the store was asked recently
    (3, False, 2 * P + 0.01, 0.0, Look.ASK),  # the pulse stopped relaying: the notice may never come
    (3, False, 0.1, STORE_FALLBACK_S, Look.ASK),  # the fallback is due (a notice lost on the way)
    (-1, False, float("inf"), 0.0, Look.ASK),  # no pulse at all: every poll asks the store
])
def test_look(told, ended, relayed_age, asked_age, want):
    assert look(4, told, ended, relayed_age, asked_age, period_s=P) is want


def test_told_only_grows_and_skips_what_it_cannot_read():
    t = notices.Told()
    assert (t.generation, t.ended) == (-1, False)
    assert t.take({"plan": 2}) and t.generation == 2
    assert not t.take({"plan": 1}) and t.generation == 2  # late and older
    assert not t.take({"plan": "x"}) and not t.take({"probe": {"id": 1, "peers": {}}})
    assert t.take({"shutdown": 1}) and t.ended and not t.take({"shutdown": 1})


class _Store:
    def __init__(self, keys=()):
        self.keys, self.calls = set(keys), 0

    def check(self, keys):
        self.calls += 1
        return all(k in self.keys for k in keys)


def _relaying(tmp_path, wid="w1"):
    """A rank's real page in a node directory, and the pulse's view of it (pulse.Watched)."""
    board = ProgressBoard(0, str(tmp_path), wid)
    watched = {wid: pulse.Watched(str(tmp_path), wid, 0)}
    pulse.stamp_relayed(watched, {wid: []}, time.time())
    return board, watched


def test_while_the_pulse_relays_a_rank_reads_its_page_and_asks_the_store_only_as_a_fallback(tmp_path):
    board, watched = _relaying(tmp_path)
    store = _Store()
    w = PlanWatch(store, board, P, fallback_s=30.0)
    assert not w.out(1) and store.calls == 1  # the first look asks (nothing asked yet)
    for _ in range(50):
        assert not w.out(1)
    assert store.calls == 1  # page reads only
    told = notices.Told()
    told.take({"plan": 1})
    pulse.stamp_told(watched, told)  # what the pulse does on the supervisor's notice
    assert w.out(1) and not w.out(2) and store.calls == 1
    told.take({"shutdown": 1})
    pulse.stamp_told(watched, told)
    assert w.seen(2, shutdown=True) is Look.ENDED and w.seen(2) is Look.WAIT and store.calls == 1
    board.close()


def test_without_a_relaying_pulse_every_look_asks_the_store(tmp_path):
    board = ProgressBoard(0)  # an anonymous page: no pulse reads it, none relays
    store = _Store({StoreKey.SHUTDOWN.value})
    w = PlanWatch(store, board, P)
    assert [w.out(3) for _ in range(5)] == [False] * 5 and store.calls == 5
    assert w.seen(3, shutdown=True) is Look.ENDED and store.calls == 7  # the plan, then the shutdown key
    store.keys.add(StoreKey.PLAN.of(3))
    assert w.out(3)
    board.close()


def test_a_pulse_that_stops_relaying_hands_the_rank_back_to_the_store(tmp_path):
    board, watched = _relaying(tmp_path)
    store = _Store()
    w = PlanWatch(store, board, P, fallback_s=30.0)
    w.out(1)
    w.out(1)
    assert store.calls == 1
    pulse.stamp_relayed(watched, {"w1": []}, time.time() - 3 * P)  # its last line: 3 periods ago
    w.out(1)
    w.out(1)
    assert store.calls == 3
    board.close()


def test_the_pulse_keeps_the_newest_plans_on_file_and_the_rank_reads_the_nodes_copy(tmp_path):
    board, watched = _relaying(tmp_path)
    store = _Store()
    store.get = lambda key: b"from the store:" + key.encode()
    told = notices.Told(str(tmp_path))
    for g in range(5):
        assert told.take({"plan": g, "body": f'{{"generation": {g}}}'})
    assert not told.take({"plan": 1, "body": "old"})  # late: neither kept nor counted
    kept = sorted(p.name for p in tmp_path.glob("plan.*"))
    assert kept == ["plan.3", "plan.4"] and oct((tmp_path / "plan.4").stat().st_mode & 0o777) == "0o600"
    w = PlanWatch(store, board, P)
    assert w.text(4) == b'{"generation": 4}'
    assert w.text(1) == b"from the store:plan/1"  # no longer kept: the store's copy
    board.close()
