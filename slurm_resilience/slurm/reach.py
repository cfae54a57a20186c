"""Does a node's slurmd port take a TCP connection? Asked of a node gone silent.

One connect with the whole deadline is the wrong question after a flap: its one SYN,
lost while the link was down, is resent only after the kernel's 1 s SYN time-out, so a
node back on the network 50 ms later would still be called unreachable. So a fresh
attempt (a new SYN) starts every ``CONNECT_RETRY_S`` until one connects or the deadline
passes. A refused connection is an answer at once: the host is up, its slurmd is not.
"""

from __future__ import annotations

import socket
import time

__all__ = ["CONNECT_RETRY_S", "port_reachable"]

CONNECT_RETRY_S = 0.05


def port_reachable(addr: str, port: int, timeout_s: float, every_s: float = CONNECT_RETRY_S) -> bool:
    """True once a connection to ``addr:port`` succeeds within ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        t0 = time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=min(every_s, left)):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:  # no answer in time (a dropped SYN), unreachable, ...
            time.sleep(max(0.0, min(every_s - (time.monotonic() - t0), end - time.monotonic())))
