"""A link that flapped: the node pulse replaces its stuck connection, the supervisor's
slurmd probe sends a fresh SYN rather than wait for the kernel's 1 s resend.

Real sockets on loopback. A listener with a full accept queue drops new SYNs, as a cut
link does, until one pending connection is accepted.
"""

from __future__ import annotations

import socket
import threading
import time

from slurm_resilience.slurm.reach import port_reachable
from slurm_resilience.worker import pulse_link
from slurm_resilience.worker.pulse_link import RETRY_S, STUCK_MAX_S, STUCK_S, Link


def _full_listener():
    """A listener whose accept queue is full: a new SYN is dropped (no answer, no RST)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    fillers = []
    for _ in range(8):  # backlog 0 still queues one or two; fill it whatever the kernel allows
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(srv.getsockname())
        fillers.append(c)
    return srv, fillers


def _drain(srv):
    """Accept what is queued: new SYNs get an answer again."""
    srv.setblocking(False)
    try:
        while True:
            srv.accept()[0].close()
    except OSError:
        pass


def test_a_dropped_syn_then_a_link_back_is_reached_by_a_fresh_attempt():
    srv, fillers = _full_listener()
    try:
        assert not port_reachable(*srv.getsockname(), 0.3)  # SYNs dropped: no answer in time
        threading.Timer(0.2, _drain, args=(srv,)).start()  # the link is back
        # one connect would wait for the kernel's 1 s SYN resend and miss this deadline
        assert port_reachable(*srv.getsockname(), 0.9)
    finally:
        for c in fillers:
            c.close()
        srv.close()


def test_a_refused_port_is_an_answer_at_once():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert not port_reachable("127.0.0.1", port, 5.0)


def test_link_rule_stuck_after_stuck_s_retries_every_retry_s_and_backs_off_after_a_swap():
    e = 1e-6  # past each boundary (float sums)
    link = Link()
    assert not link.look(False, 0.0) and link.retry_in(0.0) == float("inf")
    assert not link.look(True, 1.0)  # first seen timed out
    assert not link.look(True, 1.0 + STUCK_S / 2)
    assert link.look(True, 1.0 + STUCK_S + e)  # stuck: try a fresh connection
    assert not link.look(True, 1.0 + STUCK_S + RETRY_S / 2)  # not again before RETRY_S
    assert link.look(True, 1.0 + STUCK_S + RETRY_S + 2 * e)
    link.swapped(2.0)
    assert link.replaced == 1 and link.wait == 2 * STUCK_S
    assert not link.look(True, 2.0) and not link.look(True, 2.0 + STUCK_S)  # a new link gets longer
    assert link.look(True, 2.0 + 2 * STUCK_S + e)
    assert not link.look(False, 3.0) and link.wait == STUCK_S  # acknowledged: back to the short wait
    for _ in range(10):
        link.swapped(4.0)
    assert link.wait == STUCK_MAX_S


def test_unacked_counts_bytes_a_silent_peer_has_not_taken():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    try:
        c.sendall(b"x" * 100)
        deadline = time.monotonic() + 5
        while pulse_link.unacked(c) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pulse_link.unacked(c) == 0  # loopback acknowledges at once
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.setblocking(False)
        sent = 0
        try:
            while sent < 64 << 20:
                sent += c.send(b"y" * 65536)
        except BlockingIOError:
            pass  # the peer's window is shut: what is left sits unacknowledged
        assert pulse_link.unacked(c) > 0
    finally:
        c.close()
        peer.close()
        srv.close()
