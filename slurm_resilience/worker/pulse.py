"""The pulse: a tiny process that vouches for one rank while its interpreter cannot.

Started by the rank (``progress.start_pulse``) as ``python -I pulse.py``: the standard
library only, no torch, no package import (~10 MB, ~30 ms to start). It shares one
page with the rank (``progress.ProgressBoard``, an mmap'ed file descriptor inherited
with ``pass_fds``) and connects to the supervisor's liveness socket with the job's
token (read from stdin, never argv). Every ``period`` seconds it sends one JSON line::

    {"progress": 41, "waiting": 0, "step": 12, "state": "S", "cpu": 1234, "t": 1.7e9}

``progress`` is the counter the rank's main thread bumps at every completed step and
phase, ``waiting`` says what the main thread is in: 0 the user's code, 1 a bounded
wait on its peers or on the supervisor's plan, 2 the toolkit's own checkpoint I/O
(a restore, a final save), ``state`` and ``cpu`` (utime + stime ticks) come from
``/proc/PID/stat``. Nothing here needs the rank's GIL or its CPU share: a rank whose
main thread holds the GIL, or whose threads the scheduler starves, still has a
pulse; a rank whose process is gone is reported at once (``pidfd`` turns readable
when it exits), a stopped one (``state`` T) within a period.

When the supervisor restarts, its new liveness port is what the rank's heartbeat
thread wrote into the shared page; the pulse reconnects there.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import struct
import sys
import time

# The shared page (little-endian): progress u64, waiting u32, liveness port u32, step u64.
COMPUTING, WAITING, BUSY = 0, 1, 2  # values of ``waiting``
LAYOUT = struct.Struct("<QIIQ")
PAGE = 4096


def read_board(page: mmap.mmap) -> tuple[int, int, int, int]:
    """(progress, waiting, port, step) as the rank last wrote them."""
    return LAYOUT.unpack_from(page, 0)


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, utime + stime ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rindex(b")") + 2:].split()  # the command name may hold spaces and parens
    return rest[0].decode(), int(rest[11]) + int(rest[12])


def _connect(host: str, port: int, hello: dict) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=2)
        sock.sendall((json.dumps(hello) + "\n").encode())
        sock.setblocking(False)
        return sock
    except OSError:
        return None


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def run(*, pid: int, fd: int, host: str, period: float, hello: dict) -> int:
    page = mmap.mmap(fd, PAGE)
    try:
        watch = os.pidfd_open(pid)  # readable when the rank exits (Linux >= 5.3)
    except (AttributeError, OSError):
        watch = None
    port = read_board(page)[2]
    sock = _connect(host, port, hello)
    while True:
        waits = [watch] if watch is not None else []
        gone = bool(select.select(waits, [], [], period)[0]) if waits else (time.sleep(period) or False)
        st = proc_stat(pid)
        if gone or st is None or st[0] in ("Z", "X"):
            if sock is not None:
                _send(sock, {"gone": True, "t": time.time()})
            return 0
        if sock is None or _closed(sock):
            new = read_board(page)[2]
            if sock is not None and new == port:
                continue  # the supervisor is restarting; its new port is not known yet
            if sock is not None:
                sock.close()
            port, sock = new, _connect(host, new, hello)
            if sock is None:
                continue
        progress, waiting, _, step = read_board(page)
        if not _send(sock, {"progress": progress, "waiting": waiting, "step": step,
                            "state": st[0], "cpu": st[1], "t": time.time()}):
            sock.close()
            sock = None


def _send(sock: socket.socket, msg: dict) -> bool:
    try:
        sock.sendall((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        return True
    except (BlockingIOError, OSError):
        return False


def main() -> int:
    cfg = json.loads(sys.stdin.readline())
    sys.stdin.close()
    return run(pid=int(cfg["pid"]), fd=int(cfg["fd"]), host=str(cfg["host"]),
               period=float(cfg["period"]), hello=dict(cfg["hello"]))


if __name__ == "__main__":
    sys.exit(main())
