"""The node pulse's connection to the supervisor, and when to replace it.

Standard library only: loaded by ``pulse.py`` (``python -I``) by path. A link that stops
taking lines (a flap: a cable, a switch port, a partition healed) is replaced, not waited
out. What the cut dropped, TCP resends only at its retransmission time-out, which doubles
at every loss (0.2, 0.4, 0.8 s...), so a node back after 0.5 s could stay unheard for
another second and be taken for lost. So when the kernel itself has timed out a segment
the pulse sent (``TCP_INFO``: an RTO fired, ``tcpi_retransmits`` > 0, with bytes still
unacknowledged) for ``STUCK_S``, the pulse tries a fresh connection every ``RETRY_S`` (a new
SYN each time, ``RETRY_S`` deadline) and, once one connects, sends its line there and
drops the old one: a node is heard again within about ``RETRY_S`` of the link's return
(the node-silence deadline, ``supervisor/observe/silence.py``, counts on it). Bytes that
wait only for a delayed ACK (up to 200 ms) or for a peer's full window (a supervisor that
stopped reading) fire no RTO and replace nothing: a new link would not help there. After a
replacement that gets stuck in turn the pulse waits twice as long before the next, up to
``STUCK_MAX_S``.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios

__all__ = ["STUCK_S", "STUCK_MAX_S", "RETRY_S", "connect", "unacked", "timed_out", "Link"]

STUCK_S = 0.05  # a segment timed out (an RTO fired, >= 200 ms after it was sent) this long: the link is cut
STUCK_MAX_S = 2.0  # the longest wait before replacing a link again (doubling from STUCK_S)
RETRY_S = 0.05  # between fresh connection attempts (and each one's deadline) while it is


def connect(host: str, port: int, hello: dict, timeout: float = 0.25) -> socket.socket | None:
    """A new connection that has said hello; None when none came within ``timeout``."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None
    try:
        sock.sendall((json.dumps(hello) + "\n").encode())
        sock.setblocking(False)
        return sock
    except OSError:
        sock.close()
        return None


def unacked(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not acknowledged yet (Linux ``SIOCOUTQ``)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def timed_out(sock: socket.socket) -> bool:
    """Bytes sent on ``sock`` wait unacknowledged after the kernel's retransmission time-out
    fired for them (loss, not a delayed ACK or a shut window)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
    except OSError:
        return False
    return info[2] > 0 and unacked(sock) > 0  # tcpi_retransmits: RTOs since the last ACK


class Link:
    """When the pulse's connection to the supervisor counts as stuck (module docstring):
    :meth:`look`, after every wake-up with :func:`timed_out`'s word, says whether to try a
    fresh connection now."""

    def __init__(self) -> None:
        self.since: float | None = None  # first seen timed out
        self.wait = STUCK_S  # how long they may stay so
        self.tried = float("-inf")  # the last fresh attempt
        self.replaced = 0  # links replaced (for tests and logs)

    def look(self, stuck: bool, now: float) -> bool:
        """``stuck``: the link has timed out bytes now. True: try a fresh connection."""
        if not stuck:
            self.since, self.wait = None, STUCK_S
            return False
        if self.since is None:
            self.since = now
        if now - self.since < self.wait or now - self.tried < RETRY_S:
            return False
        self.tried = now
        return True

    def swapped(self, now: float) -> None:
        """A fresh connection replaced the stuck one."""
        self.replaced += 1
        self.since, self.wait = None, min(STUCK_MAX_S, 2 * self.wait)

    def retry_in(self, now: float) -> float:
        """Seconds until the next look is due while the link is stuck (inf: not stuck)."""
        if self.since is None:
            return float("inf")
        return max(0.0, max(self.since + self.wait, self.tried + RETRY_S) - now)
