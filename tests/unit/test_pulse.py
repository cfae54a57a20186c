"""The pulse (worker/pulse.py + progress.py) against the real liveness server (detect.py):
a real process, a real shared page, real sockets. No torch in the pulse process."""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time

import pytest

from slurm_resilience.supervisor.detect import LivenessServer

TOKEN = "t" * 32

RANK = r"""
import sys, time
from slurm_resilience.worker.progress import ProgressBoard, start_pulse
board = ProgressBoard(int(sys.argv[1]))
pulse = start_pulse(board, host="127.0.0.1", period_s=0.05,
                    hello={"token": sys.argv[2], "worker_id": "w1", "node": "n1", "pid": 0})
print(pulse.pid, flush=True)
for line in sys.stdin:  # each line: one completed step
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


def test_pulse_reports_progress_state_and_a_dead_rank_at_once(server):
    srv, out = server
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(srv.port), TOKEN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        pulse_pid = int(rank.stdout.readline())
        first = _until(lambda: srv.pulses().get("w1"))
        assert first.progress == 0 and first.state in "RS" and not first.waiting
        rank.stdin.write("7\n")
        rank.stdin.flush()
        assert rank.stdout.readline().strip() == "ok"
        moved = _until(lambda: (p := srv.pulses()["w1"]).progress == 1 and p)
        assert moved.step == 7
        os.kill(rank.pid, signal.SIGSTOP)  # the rank is stopped; its pulse is not
        _until(lambda: srv.pulses()["w1"].state == "T")
        os.kill(rank.pid, signal.SIGCONT)
        _until(lambda: srv.pulses()["w1"].state != "T")
        assert not [o for o in _drain(out) if o.kind == "closed"]  # a pulse is no "connected" worker
        t0 = time.time()
        rank.kill()
        rank.wait(timeout=10)
        closed = _until(lambda: [o for o in _drain(out) if o.kind == "closed"])
        assert closed[0].worker_id == "w1" and closed[0].detail == "pulse: process gone"
        assert closed[0].time - t0 < 5.0  # pidfd: at once, not after a staleness timeout
        _until(lambda: not os.path.exists(f"/proc/{pulse_pid}") or open(f"/proc/{pulse_pid}/stat").read().split()[2] == "Z")
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait(timeout=10)


def test_a_pulse_with_a_bad_token_is_rejected(server):
    srv, _ = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(json.dumps({"token": "x", "worker_id": "w9", "node": "n", "pid": 1, "pulse": True}).encode() + b"\n")
        s.sendall(b'{"progress":1,"waiting":0,"step":1,"state":"S","cpu":0,"t":0}\n')
        assert s.recv(16) == b""
    assert "w9" not in srv.pulses() and srv.rejected == 1


def test_torn_and_foreign_lines_are_skipped(server):
    srv, out = server
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(json.dumps({"token": TOKEN, "worker_id": "w2", "node": "n", "pid": 1, "pulse": True}).encode()
                  + b'\n{"progress":3,"waiting":1,"step":2,"state":"S","cpu":5,"t":0}\nnot json\n{"progress":')
        p = _until(lambda: srv.pulses().get("w2"))
        assert (p.progress, p.waiting, p.step, p.cpu) == (3, True, 2, 5)
        s.sendall(b'4,"waiting":0,"step":3,"state":"R","cpu":6,"t":0}\n')
        _until(lambda: srv.pulses()["w2"].progress == 4)
    time.sleep(0.2)
    assert not [o for o in _drain(out) if o.kind in ("connected", "closed")]


def test_the_page_shows_the_innermost_phase():
    from slurm_resilience.worker.progress import ProgressBoard

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

    from slurm_resilience.protocol import Role, WorkerEnv, heartbeat_key
    from slurm_resilience.supervisor.detect import read_heartbeats
    from slurm_resilience.supervisor.progress import ProgressWatch, Verdict, progress_in
    from slurm_resilience.worker.heartbeat import Heartbeat

    srv, _ = server
    base = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    store = dist.PrefixStore(TOKEN + "/", base)
    env = WorkerEnv(store_addr="127.0.0.1", store_port=base.port, liveness_port=srv.port, token=TOKEN, job_dir="",
                    worker_id="w1", node="n1", role=Role.RANK, generation=0, config_path="", job_id="j",
                    run_id="0" * 32)
    hb = Heartbeat(env, 0.05).start()
    watch = ProgressWatch(stale_s=1.0, soft_s=0.6, hard_s=1.2, factor=2, pulse_s=0.3)

    def look():
        beat = read_heartbeats(store, {"w1": heartbeat_key("w1")})["w1"]
        now = time.time()
        watch.observe({"w1": beat["t"]}, srv.pulses(), now, hb_progress={"w1": progress_in(beat)})
        return watch.verdicts["w1"]

    try:
        _until(lambda: srv.pulses().get("w1"))
        hb.update(step=3)  # the main thread completed a step
        beat = _until(lambda: (b := read_heartbeats(store, {"w1": heartbeat_key("w1")})["w1"]) and b["step"] == 3 and b)
        assert progress_in(beat) == (1, 0, 3)
        os.kill(hb._pulse.pid, signal.SIGKILL)  # the pulse process this test's Heartbeat started
        hb._pulse.wait(timeout=10)
        verdict, why = _until(lambda: (v := look())[0] is Verdict.HUNG and v)  # the main thread is stuck
        assert "progress from its heartbeat; pulse silent" in why, why
        hb.update(step=4)  # it moves again: no hang, only the missing pulse is reported
        verdict, why = _until(lambda: (v := look())[0] is not Verdict.HUNG and v)
        assert verdict is Verdict.SUSPECT and "pulse silent" in why, why
    finally:
        hb.stop()
