"""The node's pulse (worker/pulse.py + progress.py) against the real liveness server
(detect.py): real processes, real shared pages, real sockets. No torch in the pulse."""

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from slurm_resilience.supervisor.observe.detect import LivenessServer

TOKEN = "t" * 32

RANK = r"""
import sys, time
from slurm_resilience.worker.progress_page import ProgressBoard, ensure_pulse
port, token, directory, wid = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
board = ProgressBoard(port, directory, wid)
pulse = ensure_pulse(directory, host="127.0.0.1", period_s=0.05,
                     hello={"token": token, "worker_id": "pulse@n1", "node": "n1", "pid": 0})
print(pulse.pid if pulse else 0, flush=True)
for line in sys.stdin:  # each line: one completed step; "leave": end cleanly
    if line.strip() == "leave":
        board.leave()
        print("left", flush=True)
        break
    if line.startswith("beat"):  # "beat GEN RANK MS": the heartbeat thread's write
        g, r, ms = line.split()[1:]
        board.beat(time.time(), int(g), int(r), float(ms))
        print("ok", flush=True)
        continue
    if line.strip() == "relayed":
        print(board.relayed(), flush=True)
        continue
    if line.strip() == "told":
        print(*board.told(), flush=True)
        continue
    board.bump(step=int(line))
    print("ok", flush=True)
"""


def _until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture
def server():
    out = queue.Queue()
    srv = LivenessServer("127.0.0.1", TOKEN, out).start()
    yield srv, out
    srv.close()


def _drain(out):
    seen = []
    while not out.empty():
        seen.append(out.get_nowait())
    return seen


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _node_dir(tmp_path):
    """The node's pulse directory, as ``progress.pulse_dir`` makes it (0700)."""
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    return directory


def _end(*procs):
    """Kill the rank processes a test started (those still running)."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _rank(srv, directory, wid):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", RANK, str(srv.port), TOKEN, str(directory), wid],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def test_one_pulse_per_node_reports_every_rank_its_state_and_a_dead_rank_at_once(server, tmp_path):
    srv, out = server
    directory = _node_dir(tmp_path)
    a = _rank(srv, directory, "w1")
    b = None
    try:
        pulse_pid = int(a.stdout.readline())
        assert pulse_pid > 0  # the first rank of the node started it
        b = _rank(srv, directory, "w2")
        assert int(b.stdout.readline()) == 0  # the second found it running: one per node
        first = _until(lambda: srv.pulses().get("w1"))
        assert first.progress == 0 and first.state in "RS" and not first.waiting
        _until(lambda: srv.pulses().get("w2"))
        a.stdin.write("7\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "ok"
        moved = _until(lambda: (p := srv.pulses()["w1"]).progress == 1 and p)
        assert moved.step == 7
        os.kill(a.pid, signal.SIGSTOP)  # the rank is stopped; the node's pulse is not
        _until(lambda: srv.pulses()["w1"].state == "T")
        os.kill(a.pid, signal.SIGCONT)
        _until(lambda: srv.pulses()["w1"].state != "T")
        assert not [o for o in _drain(out) if o.kind in ("connected", "closed")]  # a pulse is no worker
        t0 = time.time()
        b.kill()
        b.wait(timeout=10)
        closed = _until(lambda: [o for o in _drain(out) if o.kind == "closed"])
        assert [(o.worker_id, o.node, o.detail) for o in closed] == [("w2", "n1", "pulse: process gone")]
        assert closed[0].pid == b.pid and closed[0].time - t0 < 5.0  # pidfd: at once
        assert not (directory / "w2.rank").exists() and not (directory / "w2.board").exists()
        a.stdin.write("leave\n")  # a clean end: dropped without a "gone"
        a.stdin.flush()
        assert a.stdout.readline().strip() == "left"
        a.wait(timeout=10)
        _until(lambda: not _alive(pulse_pid), timeout=30)  # no rank left: the pulse exits
        assert not [o for o in _drain(out) if o.kind == "closed"]
    finally:
        _end(a, b)


def test_the_node_pulse_folds_each_ranks_heartbeat_into_its_line_and_stamps_it_relayed(server, tmp_path):
    srv, _ = server
    directory = _node_dir(tmp_path)
    a = _rank(srv, directory, "w1")
    try:
        assert int(a.stdout.readline()) > 0
        first = _until(lambda: srv.pulses().get("w1"))
        assert first.beat() is None  # no beat yet: the supervisor reads the store for this rank
        t0 = time.time()
        a.stdin.write("beat 3 5 12.5\n")
        a.stdin.flush()
        assert a.stdout.readline().strip() == "ok"
        p = _until(lambda: (p := srv.pulses()["w1"]).beat_t > 0 and p)
        beat = p.beat()
        assert beat["generation"] == 3 and beat["rank"] == 5 and beat["compute_ms"] == 12.5
        assert t0 - 0.001 <= beat["t"] <= time.time() and beat["phase"] == 0  # ms resolution on the wire

        def relayed():
            a.stdin.write("relayed\n")
            a.stdin.flush()
            return float(a.stdout.readline()) >= beat["t"]
        assert _until(relayed)  # the rank's heartbeat thread can tell its beats reach the supervisor
    finally:
        a.kill()
        a.wait(timeout=10)


def test_the_supervisors_plan_and_shutdown_notices_reach_every_ranks_page_through_the_node_pulse(server, tmp_path):
    srv, _ = server
    directory = _node_dir(tmp_path)
    a = _rank(srv, directory, "w1")
    b = None

    def told(p):
        p.stdin.write("told\n")
        p.stdin.flush()
        g, ended = p.stdout.readline().split()
        return int(g), ended == "True"
    try:
        assert int(a.stdout.readline()) > 0
        _until(lambda: srv.pulses().get("w1"))
        assert told(a) == (-1, False)  # nothing told yet
        three = _plan_text(3, ["n1", "n2"])
        srv.tell({"plan": 3, "body": three})
        _until(lambda: told(a) == (3, False))
        assert (directory / "plan.3").read_text() == three  # on file before the page said 3
        srv.tell({"plan": 2})  # a late, older notice changes nothing
        b = _rank(srv, directory, "w2")  # a rank that arrives after the notice gets it too
        assert int(b.stdout.readline()) == 0
        _until(lambda: told(b) == (3, False))
        assert told(a) == (3, False)
        four = _plan_text(4, ["n1", "n7"])  # plan 3 was taken whole: plan 4 goes as a delta
        srv.tell({"plan": 4, "body": four}, nodes=["n1", "n1"])
        _until(lambda: told(a) == (4, False))
        assert (directory / "plan.4").read_text() == four  # rebuilt by the pulse, byte for byte
        srv.tell({"shutdown": 1}, nodes=["n1", "n9"])  # a node without a pulse is no failure
        _until(lambda: told(a) == (4, True) and told(b) == (4, True))
        assert srv.tell_failed == 0
    finally:
        _end(a, b)


def _plan_text(g, nodes, tasks_per_node=2):
    from slurm_resilience.model import RankTable
    from slurm_resilience.protocol import Plan, PlanAction
    from slurm_resilience.supervisor.decide.ranktable import initial_table

    ids = [f"{n}.{i * tasks_per_node + k}" for i, n in enumerate(nodes) for k in range(tasks_per_node)]
    table = initial_table(nodes, ids, {n: "127.0.0.1" for n in nodes}, tasks_per_node=tasks_per_node)
    return Plan(generation=g, action=PlanAction.RUN, table=RankTable(g, table.slots), joining=(2, 3),
                reason="test").to_json()


def test_a_plan_goes_whole_to_a_new_connection_and_as_a_delta_to_one_that_took_the_last(server):
    """Each node's pulse gets one line per plan: the whole plan, or only what changed since
    the plan it took whole (a replaced node: a few hundred bytes at any size). A delta that
    does not fit what the pulse holds is not kept: its ranks ask the store."""
    from slurm_resilience.worker import notices

    srv, _ = server
    hello = json.dumps({"token": TOKEN, "worker_id": "pulse@n1", "node": "n1", "pid": 1, "agent": True}).encode()
    nodes = [f"n{i}" for i in range(1, 65)]
    one, two = _plan_text(1, nodes), _plan_text(2, nodes[:5] + ["n99"] + nodes[6:])

    def lines(sock, n):
        buf = b""
        while buf.count(b"\n") < n:
            buf += sock.recv(1 << 20)
        return [json.loads(x) for x in buf.split(b"\n")[:n]]
    with socket.create_connection(("127.0.0.1", srv.port)) as old:
        old.sendall(hello + b'\n{"t":1,"ranks":{},"gone":{}}\n')
        _until(lambda: "n1" in srv.endpoints() or srv.heard().get("n1"))
        srv.tell({"plan": 1, "body": one}, nodes=["n1"])
        told = notices.Told()
        (first,) = lines(old, 1)
        assert first == {"plan": 1, "body": one} and told.take(first) and told.body(1) == one
        srv.tell({"plan": 2, "body": two}, nodes=["n1"])
        (second,) = lines(old, 1)
        assert "body" not in second and second["base"] == 1 and len(json.dumps(second)) < len(two) // 10
        assert told.take(second) and told.body(2) == two
        stale = notices.Told()  # holds no plan 1: the delta cannot be rebuilt
        assert stale.take(second) and stale.generation == 2 and stale.body(2) is None
        bad = notices.Told()
        bad.take(first)
        assert bad.take(dict(second, crc=second["crc"] ^ 1)) and bad.body(2) is None  # a wrong CRC: not kept
        with socket.create_connection(("127.0.0.1", srv.port)) as new:  # the pulse reconnected
            new.sendall(hello + b'\n{"t":2,"ranks":{},"gone":{}}\n')
            _until(lambda: srv.heard().get("n1", 0) and _conn_is(srv, "n1", new))
            three = _plan_text(3, nodes[:5] + ["n99"] + nodes[6:-1])  # scale-in: a node fewer
            srv.tell({"plan": 3, "body": three}, nodes=["n1"])
            (whole,) = lines(new, 1)
            assert whole == {"plan": 3, "body": three}  # it took no plan on this connection
    assert srv.tell_failed == 0


def _conn_is(srv, node, sock):
    with srv._lock:
        conn = srv._conns.get(node)
    return conn is not None and conn.getpeername() == sock.getsockname()


def test_a_pulse_with_a_bad_token_is_rejected(server):
    srv, _ = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(json.dumps({"token": "x", "worker_id": "pulse@n", "node": "n", "pid": 1, "agent": True}).encode()
                  + b"\n")
        try:
            s.sendall(b'{"t":0,"ranks":{"w9":[1,1,0,1,"S",0]},"gone":{}}\n')
            assert s.recv(16) == b""
        except ConnectionResetError:  # closed with this line unread: the kernel answers with a reset
            pass
    assert "w9" not in srv.pulses() and srv.rejected == 1


def test_torn_and_foreign_lines_are_skipped(server):
    srv, out = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(json.dumps({"token": TOKEN, "worker_id": "pulse@n", "node": "n", "pid": 1, "agent": True}).encode()
                  + b'\n{"t":0,"ranks":{"w2":[1,3,1,2,"S",5]},"gone":{}}\nnot json\n{"t":0,"ranks":{"w2":[1,')
        p = _until(lambda: srv.pulses().get("w2"))
        assert (p.progress, p.waiting, p.step, p.cpu) == (3, True, 2, 5)
        s.sendall(b'4,0,3,"R",6]},"gone":{}}\n')
        _until(lambda: srv.pulses()["w2"].progress == 4)
    time.sleep(0.2)
    assert not [o for o in _drain(out) if o.kind in ("connected", "closed")]


def test_an_entry_is_read_alike_on_the_fast_path_and_converted_and_a_wrong_one_skips_its_line():
    from slurm_resilience.supervisor.observe.pulse_line import Pulse, pulse_entry as _pulse

    entry = [41, 7, 2, 3, "S", 9, 1700000000.25, 4, 5, 12.5]  # the types the pulse packs: taken as they are
    fast = _pulse(2.0, entry)
    assert type(fast) is Pulse and fast == Pulse(2.0, 7, False, 3, "S", 9, True, 1700000000.25, 4, 5, 12.5)
    assert _pulse(2.0, [41, 7.0, "2", 3.0, "Sleeping", 9, 1700000000.25, 4, 5, "12.5"]) == fast  # converted
    assert _pulse(2.0, [41, 7, 1, 3, "R", 9]) == Pulse(2.0, 7, True, 3, "R", 9, False, 0.0, -1, -1, -1.0)  # older
    for bad in ([41, 7, 1, "x", "R", 9], [41, 7, 1, 3, "R", 9, "t", 4, 5, 1.0], [41, 7]):
        with pytest.raises((ValueError, TypeError)):
            _pulse(2.0, bad)


def test_with_many_node_pulses_the_reader_batches_its_wakes_and_still_takes_every_line_and_death(monkeypatch):
    from slurm_resilience.supervisor.observe import detect

    monkeypatch.setattr(detect, "COALESCE_FROM", 3)  # as with >= 128 pulses, on 4 connections
    out = queue.Queue()
    srv = LivenessServer("127.0.0.1", TOKEN, out).start()
    socks = []
    try:
        for n in range(4):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(json.dumps({"token": TOKEN, "worker_id": f"pulse@n{n}", "node": f"n{n}", "pid": 1,
                                  "agent": True}).encode() + b"\n")
            socks.append(s)
        for n, s in enumerate(socks):
            s.sendall(json.dumps({"t": 0, "ranks": {f"n{n}.0": [7, 3, 0, 2, "S", 5, 1.5, 0, n, 1.0]},
                                  "gone": {}}).encode() + b"\n")
        _until(lambda: len(srv.pulses()) == 4)
        socks[2].sendall(json.dumps({"t": 0, "ranks": {}, "gone": {"n2.0": 7}}).encode() + b"\n")
        closed = _until(lambda: [o for o in _drain(out) if o.kind == "closed"])
        assert [(o.worker_id, o.node, o.pid) for o in closed] == [("n2.0", "n2", 7)]
        assert srv.pauses > 0 and detect.COALESCE_S <= 0.005
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_small_job_s_reader_never_pauses(server):
    srv, _ = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(json.dumps({"token": TOKEN, "worker_id": "pulse@n", "node": "n", "pid": 1, "agent": True}).encode()
                  + b'\n{"t":0,"ranks":{"w2":[1,3,1,2,"S",5]},"gone":{}}\n')
        _until(lambda: srv.pulses().get("w2"))
    assert srv.pauses == 0


def test_lines_resent_late_on_a_replaced_link_are_superseded(server):
    """The pulse moved to a fresh connection (pulse_link.py); TCP still delivers what sat
    on the old one. Those old lines say nothing new: only the current link's count."""
    srv, out = server
    hello = json.dumps({"token": TOKEN, "worker_id": "pulse@n", "node": "n", "pid": 1, "agent": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as old:
        old.sendall(hello + b'\n{"t":1,"ranks":{"w2":[1,3,0,3,"S",5]},"gone":{}}\n')
        _until(lambda: srv.pulses().get("w2"))
        with socket.create_connection(("127.0.0.1", srv.port)) as new:
            new.sendall(hello + b'\n{"t":3,"ranks":{"w2":[1,7,0,7,"S",9]},"gone":{}}\n')
            _until(lambda: srv.pulses()["w2"].progress == 7)
            old.sendall(b'{"t":2,"ranks":{"w2":[1,5,0,5,"S",7]},"gone":{"w3":4}}\n')  # resent late
            _until(lambda: any(o.kind == "closed" and o.worker_id == "w3" for o in _drain(out)))  # "gone" counts
            assert srv.pulses()["w2"].progress == 7  # the progress it carried does not
            new.sendall(b'{"t":4,"ranks":{"w2":[1,8,0,8,"S",9]},"gone":{}}\n')
            _until(lambda: srv.pulses()["w2"].progress == 8)


def test_the_page_shows_the_innermost_phase():
    from slurm_resilience.worker.progress_page import ProgressBoard

    board = ProgressBoard(port=1234)
    assert board.read() == (0, 0, 1234, 0)
    with board.busy():
        assert board.read()[1] == 2
        with board.waiting():  # a collective inside a checkpoint agreement
            assert board.read()[1] == 1
        assert board.read()[1] == 2
    progress, phase, port, _ = board.read()
    assert phase == 0 and port == 1234 and progress == 4  # each phase change is progress
    board.bump(step=9)
    board.set_port(4321)
    assert board.read() == (5, 0, 4321, 9)


def test_a_dead_pulse_leaves_the_progress_in_the_heartbeat_and_the_watchdog_finds_the_stuck_rank(server):
    """The rank's real heartbeat thread and pulse (this process plays the rank); the pulse is
    SIGKILLed, the main thread stops: the watchdog still sees the counter (in the beats)
    and calls the rank hung on that evidence, not a suspect until pg_timeout_s."""
    from datetime import timedelta

    import torch.distributed as dist

    from slurm_resilience.protocol import Role, StoreKey, WorkerEnv
    from slurm_resilience.supervisor.observe.heartbeats import read_heartbeats
    from slurm_resilience.supervisor.observe.watchdog import ProgressWatch, Verdict, progress_in
    from slurm_resilience.worker.heartbeat import Heartbeat

    srv, _ = server
    directory = None
    base = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    store = dist.PrefixStore(TOKEN + "/", base)
    env = WorkerEnv(store_addr="127.0.0.1", store_port=base.port, liveness_port=srv.port, token=TOKEN, job_dir="",
                    worker_id="w1", node="n1", role=Role.RANK, generation=0, config_path="", job_id="j",
                    run_id="0" * 32)
    hb = Heartbeat(env, 0.05).start()
    watch = ProgressWatch(stale_s=1.0, soft_s=0.6, hard_s=1.2, factor=2, pulse_s=0.3)

    def look():
        beat = read_heartbeats(store, {"w1": StoreKey.HEARTBEAT.of("w1")})["w1"]
        now = time.time()
        watch.observe({"w1": beat["t"]}, srv.pulses(), now, hb_progress={"w1": progress_in(beat)})
        return watch.verdicts["w1"]

    try:
        _until(lambda: srv.pulses().get("w1"))
        hb.update(step=3)  # the main thread completed a step
        key = {"w1": StoreKey.HEARTBEAT.of("w1")}
        beat = _until(lambda: (b := read_heartbeats(store, key)["w1"]) and b["step"] == 3 and b)
        assert progress_in(beat) == (1, 0, 3)
        directory, hb._pulse_dir = hb._pulse_dir, None  # the pulse stays dead (a heartbeat would restart it)
        os.kill(hb._pulse.pid, signal.SIGKILL)  # the pulse process this test's Heartbeat started
        hb._pulse.wait(timeout=10)
        verdict, why = _until(lambda: (v := look())[0] is Verdict.HUNG and v)  # the main thread is stuck
        assert "progress from its heartbeat; pulse silent" in why, why
        hb.update(step=4)  # it moves again: no hang, only the missing pulse is reported
        verdict, why = _until(lambda: (v := look())[0] is not Verdict.HUNG and v)
        assert verdict is Verdict.SUSPECT and "pulse silent" in why, why
    finally:
        hb.stop()
        from slurm_resilience.worker.progress_page import tidy_if_unused

        tidy_if_unused(hb._pulse_dir or directory)


def test_a_killed_pulse_is_restarted_by_a_rank_of_the_node(server, tmp_path, monkeypatch):
    """A pulse dies with the job step of the rank that started it; another rank's next
    heartbeat starts a new one (the lock is free), and the supervisor hears it again."""
    from datetime import timedelta

    import torch.distributed as dist

    from slurm_resilience.protocol import Role, WorkerEnv
    from slurm_resilience.worker import heartbeat as hb_mod

    srv, _ = server
    monkeypatch.setattr(hb_mod, "pulse_dir", lambda token, node: str(tmp_path))
    base = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    env = WorkerEnv(store_addr="127.0.0.1", store_port=base.port, liveness_port=srv.port, token=TOKEN, job_dir="",
                    worker_id="w5", node="n1", role=Role.RANK, generation=0, config_path="", job_id="j",
                    run_id="0" * 32)
    hb = hb_mod.Heartbeat(env, 0.05).start()
    try:
        first = hb._pulse
        assert first is not None and (tmp_path / "w5.rank").exists()
        _until(lambda: srv.pulses().get("w5"))
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        t_dead = time.time()
        again = _until(lambda: hb._pulse is not first and hb._pulse)
        assert again.pid != first.pid
        _until(lambda: srv.pulses()["w5"].t > t_dead)  # heard again through the new pulse
    finally:
        hb.stop()
    assert not (tmp_path / "w5.rank").exists()


def test_while_the_pulse_relays_the_beats_the_store_heartbeat_is_written_only_every_few_periods(server, tmp_path,
                                                                                               monkeypatch):
    """The real heartbeat thread and node pulse: the beats reach the supervisor in the pulse
    line, the store gets one every ``STORE_EVERY`` periods; with the pulse dead, every beat
    goes to the store again."""
    from datetime import timedelta

    import torch.distributed as dist

    from slurm_resilience.protocol import Role, StoreKey, WorkerEnv
    from slurm_resilience.supervisor.observe.heartbeats import read_heartbeats
    from slurm_resilience.worker import heartbeat as hb_mod

    srv, _ = server
    monkeypatch.setattr(hb_mod, "pulse_dir", lambda token, node: str(tmp_path))
    base = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    store = dist.PrefixStore(TOKEN + "/", base)
    env = WorkerEnv(store_addr="127.0.0.1", store_port=base.port, liveness_port=srv.port, token=TOKEN, job_dir="",
                    worker_id="w6", node="n1", role=Role.RANK, generation=0, config_path="", job_id="j",
                    run_id="0" * 32)
    period = 0.05
    hb = hb_mod.Heartbeat(env, period).start()

    def store_t():
        beat = read_heartbeats(store, {"w6": StoreKey.HEARTBEAT.of("w6")})["w6"]
        return beat["t"] if beat else None

    try:
        hb.update(step=9)
        _until(lambda: (p := srv.pulses().get("w6")) and p.beat_t > 0 and p.step == 9)
        _until(lambda: hb.progress.relayed() > 0)
        seen: list[float] = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # the distinct store beats over 1.5 s
            t = store_t()
            if t is not None and (not seen or t != seen[-1]):
                seen.append(t)
            time.sleep(0.01)
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        assert gaps and min(gaps) >= (hb_mod.STORE_EVERY - 0.5) * period, gaps  # never each period
        directory, hb._pulse_dir = hb._pulse_dir, None  # the pulse stays dead
        hb._pulse.kill()
        hb._pulse.wait(timeout=10)
        last = store_t()
        _until(lambda: (t := store_t()) is not None and t > last)  # the store carries the beats again
    finally:
        hb.stop()
        from slurm_resilience.worker.progress_page import tidy_if_unused

        tidy_if_unused(hb._pulse_dir or directory)


def _mute_listener():
    """A listener whose accepted sockets are never read, their window tiny."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # inherited by the accepted socket
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener


def _lines(conn, n):
    conn.settimeout(10)
    buf = b""
    while buf.count(b"\n") < n:
        chunk = conn.recv(65536)
        assert chunk, "closed"
        buf += chunk
    return [json.loads(x) for x in buf.split(b"\n")[:n]]


def test_a_full_window_is_not_a_cut_the_pulse_keeps_its_link(tmp_path):
    """A supervisor that stops reading shuts its window: the pulse's bytes wait, but no
    retransmission time-out fires, and a new link would not help: it keeps the one it has."""
    listener = _mute_listener()

    class Port:
        port = listener.getsockname()[1]
    rank = _rank(Port, _node_dir(tmp_path), "n1.0")
    try:
        listener.settimeout(30)
        first, _ = listener.accept()  # never read
        listener.settimeout(3.0)  # the window fills within ~1 s at 20 lines/s; then 2 s more
        with pytest.raises(socket.timeout):
            listener.accept()[0].close()
        first.close()
    finally:
        _end(rank)
        listener.close()


IPTABLES = shutil.which("iptables")


@pytest.mark.skipif(os.geteuid() != 0 or IPTABLES is None, reason="needs root and iptables (the lab's own rules)")
def test_a_pulse_whose_link_lost_packets_moves_to_a_fresh_connection_once_the_link_is_back(tmp_path):
    """A real cut (iptables drops the port's packets both ways, as ``local-cluster
    flap-node`` does): the kernel times out the pulse's line, the pulse's fresh SYNs are
    dropped too until the cut ends, then one connects and the lines go on there
    (worker/pulse_link.py) instead of waiting out TCP's retransmission back-off."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    class Port:
        pass
    Port.port = port
    rules = [["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
             ["INPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"]]
    rank = _rank(Port, _node_dir(tmp_path), "n1.0")
    cut = []
    try:
        listener.settimeout(30)
        first, _ = listener.accept()
        hello, _line = _lines(first, 2)
        for rule in rules:
            subprocess.run([IPTABLES, "-w", "-I", *rule], check=True)
            cut.append(rule)
        time.sleep(0.6)  # the cut lasts 0.6 s (a flap): long enough for the kernel's first RTO
        for rule in list(cut):
            subprocess.run([IPTABLES, "-w", "-D", *rule], check=True)
            cut.remove(rule)
        listener.settimeout(10)
        second, _ = listener.accept()  # the pulse's fresh connection
        hello2, line = _lines(second, 2)
        assert hello2 == hello and "n1.0" in line["ranks"]
        first.close()
        second.close()
    finally:
        for rule in cut:
            subprocess.run([IPTABLES, "-w", "-D", *rule], check=False)
        _end(rank)
        listener.close()


def test_the_close_of_a_node_s_pulse_connection_is_reported_once_and_a_replaced_link_s_is_not(server):
    """A pulse dies in a millisecond where a rank's teardown takes tens (``probe.pulse_gone``
    then asks the node's slurmd): its connection's close is a sighting of its node. The
    close of a link its pulse already replaced (``pulse_link.py``) is not."""
    srv, out = server
    hello = json.dumps({"token": TOKEN, "worker_id": "pulse@n", "node": "n", "pid": 1, "agent": True}).encode()
    old = socket.create_connection(("127.0.0.1", srv.port))
    old.sendall(hello + b'\n{"t":1,"ranks":{"w2":[1,3,0,3,"S",5]},"gone":{}}\n')
    _until(lambda: _conn_is(srv, "n", old))
    new = socket.create_connection(("127.0.0.1", srv.port))
    new.sendall(hello + b'\n{"t":2,"ranks":{"w2":[1,4,0,4,"S",5]},"gone":{}}\n')
    _until(lambda: _conn_is(srv, "n", new))
    old.close()
    time.sleep(0.2)
    assert not [o for o in _drain(out) if o.kind == "pulse_closed"]  # the replaced link: no news
    new.close()
    seen = _until(lambda: [o for o in _drain(out) if o.kind == "pulse_closed"])
    assert [(o.node, o.worker_id) for o in seen] == [("n", None)]
    with srv._lock:
        assert "n" not in srv._conns  # nothing is told to a closed connection
