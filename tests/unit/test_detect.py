"""stale_workers (pure), LivenessServer with real sockets, read_heartbeats on a real TCPStore."""

import json
import os
import queue
import socket
import time
from datetime import timedelta

import pytest

from slurm_resilience.protocol import StoreKey
from slurm_resilience.supervisor.observe.detect import LivenessServer, Sighting
from slurm_resilience.supervisor.observe.heartbeats import read_heartbeats, stale_workers

TOKEN = "0123456789abcdef0123456789abcdef"


# -- stale_workers ---------------------------------------------------------------
def test_stale_after_timeout():
    beats = {"a": 100.0, "b": 97.0, "c": 98.0}
    assert stale_workers(beats, now=100.0, timeout_s=2.0, started={}) == ["b"]


def test_exactly_at_timeout_is_not_stale():
    assert stale_workers({"a": 98.0}, now=100.0, timeout_s=2.0, started={}) == []


def test_never_beat_counts_from_start():
    beats = {"new": None, "old": None}
    started = {"new": 99.5, "old": 90.0}
    assert stale_workers(beats, now=100.0, timeout_s=2.0, started=started) == ["old"]


def test_never_beat_and_no_start_is_not_stale():
    assert stale_workers({"x": None}, now=100.0, timeout_s=2.0, started={}) == []


def test_heartbeat_wins_over_start():
    assert stale_workers({"a": 99.0}, now=100.0, timeout_s=2.0, started={"a": 0.0}) == []


def test_empty():
    assert stale_workers({}, now=1.0, timeout_s=1.0, started={}) == []


# -- LivenessServer -----------------------------------------------------------------
@pytest.fixture
def server():
    out: "queue.Queue[Sighting]" = queue.Queue()
    srv = LivenessServer("127.0.0.1", TOKEN, out).start()
    yield srv, out
    srv.close()


def _hello(token=TOKEN, wid="n1.3", node="n1", pid=4242) -> bytes:
    return (json.dumps({"token": token, "worker_id": wid, "node": node, "pid": pid}) + "\n").encode()


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=5)


def _wait_rejected(srv, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while srv.rejected < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return srv.rejected


def test_good_hello_connected_then_closed(server):
    srv, out = server
    s = _connect(srv)
    s.sendall(_hello())
    obs = out.get(timeout=10)
    assert (obs.kind, obs.worker_id, obs.node, obs.pid) == ("connected", "n1.3", "n1", 4242)
    t0 = time.time()
    s.close()
    # the close is an event the server reports (waited for, not timed: a loaded box may
    # deschedule the server thread); its timestamp is taken after the close
    obs = out.get(timeout=30)
    assert (obs.kind, obs.worker_id, obs.node, obs.pid) == ("closed", "n1.3", "n1", 4242)
    assert obs.time >= t0
    assert srv.rejected == 0


def test_hello_in_pieces(server):
    srv, out = server
    s = _connect(srv)
    data = _hello(wid="w-split")
    for i in range(0, len(data), 7):
        s.sendall(data[i:i + 7])
        time.sleep(0.005)
    assert out.get(timeout=10).worker_id == "w-split"
    s.close()
    assert out.get(timeout=10).kind == "closed"


def test_many_workers(server):
    srv, out = server
    socks = []
    for i in range(20):
        s = _connect(srv)
        s.sendall(_hello(wid=f"w{i}", pid=i))
        socks.append(s)
    got = {out.get(timeout=10).worker_id for _ in range(20)}
    assert got == {f"w{i}" for i in range(20)}
    socks[7].close()
    obs = out.get(timeout=10)
    assert (obs.kind, obs.worker_id) == ("closed", "w7")
    for s in socks:
        s.close()


def test_bytes_after_hello_ignored(server):
    srv, out = server
    s = _connect(srv)
    s.sendall(_hello() + b"trailing garbage\n")
    assert out.get(timeout=10).kind == "connected"
    s.sendall(b"more\n")
    time.sleep(0.1)
    assert out.empty()
    s.close()
    assert out.get(timeout=10).kind == "closed"


def _assert_rejected(srv, out, payload: bytes, before: int) -> None:
    s = _connect(srv)
    s.sendall(payload)
    assert _wait_rejected(srv, before + 1) == before + 1
    s.settimeout(2)
    try:
        assert s.recv(10) == b""  # the server closed the connection
    except ConnectionResetError:
        pass
    s.close()
    time.sleep(0.1)
    assert out.empty(), "a rejected connection produced an observation"


@pytest.mark.parametrize("payload", [
    _hello(token="wrong-token"),
    _hello(token=TOKEN[:-1]),
    _hello(token=""),
    b"this is not json\n",
    b"\n",
    b"[1, 2, 3]\n",
    b'{"worker_id": "x", "node": "n", "pid": 1}\n',  # no token
    b"\xff\xfe\x00\n",
], ids=["wrong", "prefix", "empty", "garbage", "blank", "list", "no-token", "binary"])
def test_bad_hello_rejected(server, payload):
    srv, out = server
    _assert_rejected(srv, out, payload, 0)


def test_oversized_hello_rejected(server):
    srv, out = server
    _assert_rejected(srv, out, b"x" * 10000, 0)


def test_rejections_count_and_server_keeps_serving(server):
    srv, out = server
    _assert_rejected(srv, out, _hello(token="nope"), 0)
    _assert_rejected(srv, out, b"junk\n", 1)
    s = _connect(srv)
    s.sendall(_hello(wid="after"))
    assert out.get(timeout=10).worker_id == "after"
    s.close()


def test_valid_token_bad_fields_rejected_and_server_survives(server):
    srv, out = server
    s = _connect(srv)
    s.sendall((json.dumps({"token": TOKEN, "worker_id": "x", "node": "n", "pid": "abc"}) + "\n").encode())
    assert _wait_rejected(srv, 1, timeout=10) == 1  # rejected, not accepted as a worker
    good = _connect(srv)
    good.sendall(_hello(wid="next"))
    obs = out.get(timeout=10)
    assert obs.worker_id == "next"
    s.close()
    good.close()


def test_close_stops_thread():
    srv = LivenessServer("127.0.0.1", TOKEN, queue.Queue()).start()
    port = srv.port
    srv.close()
    assert not srv._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).recv(1)


# -- read_heartbeats -------------------------------------------------------------------
@pytest.fixture
def store():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield dist.PrefixStore(TOKEN + "/", master)


def test_read_heartbeats(store):
    beat = {"t": 123.5, "step": 7, "pid": os.getpid(), "generation": 2, "rank": 1}
    store.set(StoreKey.HEARTBEAT.of("n1.1"), json.dumps(beat))
    store.set(StoreKey.HEARTBEAT.of("n2.2"), json.dumps({"t": 1.0, "step": 0}))
    got = read_heartbeats(store, {"n1.1": StoreKey.HEARTBEAT.of("n1.1"), "n2.2": StoreKey.HEARTBEAT.of("n2.2"),
                                  "n3.3": StoreKey.HEARTBEAT.of("n3.3")})
    assert got == {"n1.1": beat, "n2.2": {"t": 1.0, "step": 0}, "n3.3": None}


def test_read_heartbeats_none_present_and_empty(store):
    assert read_heartbeats(store, {"a": StoreKey.HEARTBEAT.of("a")}) == {"a": None}
    assert read_heartbeats(store, {}) == {}


def test_read_heartbeats_latest_value(store):
    key = StoreKey.HEARTBEAT.of("w")
    for step in range(5):
        store.set(key, json.dumps({"t": float(step), "step": step}))
    assert read_heartbeats(store, {"w": key})["w"]["step"] == 4


def test_read_heartbeats_from_a_client(store):
    """A worker-side client writes; the supervisor's master reads (the real topology)."""
    import torch.distributed as dist

    base = store.underlying_store if hasattr(store, "underlying_store") else None
    port = base.port if base is not None else None
    if port is None:
        pytest.skip("PrefixStore does not expose its store in this torch")
    client = dist.PrefixStore(TOKEN + "/", dist.TCPStore("127.0.0.1", port, None, False,
                                                         timedelta(seconds=10), wait_for_workers=False))
    client.set(StoreKey.HEARTBEAT.of("remote"), json.dumps({"t": 5.0, "step": 3}))
    assert read_heartbeats(store, {"remote": StoreKey.HEARTBEAT.of("remote")})["remote"]["step"] == 3


class _Counting:
    """A store that counts its round trips (issue 23: a poll is never one per worker)."""

    def __init__(self, store):
        self.store, self.trips = store, 0

    def check(self, keys):
        self.trips += 1
        return self.store.check(keys)

    def multi_get(self, keys):
        self.trips += 1
        return self.store.multi_get(keys)


def test_a_poll_of_many_workers_costs_two_round_trips_once_all_beat(store):
    keys = {f"n{i}.{i}": StoreKey.HEARTBEAT.of(f"n{i}.{i}") for i in range(512)}
    store.multi_set(list(keys.values()), [json.dumps({"t": 1.0, "step": i}) for i in range(512)])
    counting = _Counting(store)
    got = read_heartbeats(counting, keys)
    assert counting.trips == 2 and [got[w]["step"] for w in keys] == list(range(512))


def test_missing_heartbeats_are_found_by_bisection_not_per_key(store):
    from slurm_resilience.supervisor.observe.heartbeats import present_keys

    keys = [StoreKey.HEARTBEAT.of(f"w{i}") for i in range(1024)]
    missing = {keys[3], keys[700]}
    for k in keys:
        if k not in missing:
            store.set(k, "{}")
    counting = _Counting(store)
    assert present_keys(counting, keys) == [k for k in keys if k not in missing]
    assert counting.trips <= 2 * 2 * 10 + 1  # O(missing · log N), not 1024
    assert present_keys(counting, []) == []


def test_read_heartbeats_parses_all_at_once_and_survives_a_torn_value(store):
    store.set(StoreKey.HEARTBEAT.of("ok"), json.dumps({"t": 1.0, "step": 2}))
    store.set(StoreKey.HEARTBEAT.of("torn"), '{"t": 1.0, "st')
    store.set(StoreKey.HEARTBEAT.of("two"), '{"t": 1}, {"t": 2}')  # would shift every later value
    got = read_heartbeats(store, {w: StoreKey.HEARTBEAT.of(w) for w in ("ok", "torn", "two")})
    assert got == {"ok": {"t": 1.0, "step": 2}, "torn": None, "two": None}
