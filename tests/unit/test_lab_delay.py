"""The lab's delay-node fault (``scripts/lab_delay.py``): packets handed to an NFQUEUE
queue are held for the delay, in order, and pass at once when the process ends.

Real iptables and a real queue on an address of the loopback range no lab node
uses (127.0.0.249); root only, like the lab's other network faults."""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lab_delay.py"
ADDR, QUEUE, DELAY_MS = "127.0.0.249", 4999, 40

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("iptables") is None,
                                reason="needs root and iptables (the lab's network faults do)")


def _rules(op):
    q = ["-j", "NFQUEUE", "--queue-num", str(QUEUE), "--queue-bypass"]
    return [["iptables", op, "OUTPUT", "-d", ADDR, *q], ["iptables", op, "OUTPUT", "-s", ADDR, *q]]


def _echo_server():
    srv = socket.create_server((ADDR, 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(64):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def _round_trips(port, n=5):
    """Seconds of a connect, then of each of ``n`` one-byte echoes."""
    t0 = time.monotonic()
    with socket.create_connection((ADDR, port), timeout=10) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = [time.monotonic() - t0]
        for i in range(n):
            t = time.monotonic()
            c.sendall(bytes([i]))
            assert c.recv(1) == bytes([i])
            out.append(time.monotonic() - t)
    return out


def test_every_packet_is_held_for_the_delay_and_passes_once_the_process_ends():
    srv = _echo_server()
    port = srv.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--queue", str(QUEUE), "--delay-ms", str(DELAY_MS)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if proc.stdout.readline().strip() != b"ready":
            why = proc.stderr.read().decode()
            if "cannot bind NFQUEUE" in why:  # a kernel without nfnetlink_queue: no delay-node there
                pytest.skip(why.strip())
            pytest.fail(why)
        for rule in _rules("-I"):
            subprocess.run(rule, check=True)
        held = _round_trips(port)
        # the SYN and the SYN-ACK are each held once; so is every request and its answer
        assert all(t >= 2 * DELAY_MS / 1000 * 0.9 for t in held), held
        proc.terminate()
        assert proc.wait(10) == 0
        quick = _round_trips(port)  # nothing bound to the queue: --queue-bypass lets them through
        assert max(quick) < 2 * DELAY_MS / 1000, quick
    finally:
        for rule in _rules("-D"):
            subprocess.run(rule, check=False, capture_output=True)
        if proc.poll() is None:
            proc.kill()
        srv.close()


def test_bad_arguments_are_one_line_errors():
    out = subprocess.run([sys.executable, str(SCRIPT), "--queue", "4999", "--delay-ms", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "delay-ms" in out.stderr
