"""The node's pulse: one tiny process per node vouches for every rank there while
their interpreters cannot.

Started by whichever rank of the node first finds none running (``progress_page.ensure_pulse``,
an exclusive ``flock`` on ``pulse.lock`` in the node's pulse directory that the pulse
holds for its life) as ``python -I pulse.py``: the standard library only, no torch, no
package import (~10 MB, ~30 ms to start). Each rank shares one page with it
(``progress_page.ProgressBoard``: ``{worker}.board`` in that directory, mmap'ed by both)
and announces itself with ``{worker}.rank`` (its pid). Every ``period`` seconds the
pulse sends the supervisor's liveness socket (connected with the job's token, read
from stdin, never argv) **one** JSON line for the whole node::

    {"t": 1.7e9, "ranks": {"n1.0": [pid, progress, waiting, step, state, cpu,
                                    beat_t, generation, rank, compute_ms], ...},
     "gone": {"n1.1": pid}}

so the supervisor reads N/G lines a period from N/G connections, not N from N (the
control plane at scale: docs/scale.md). ``progress`` is the counter the rank's main
thread bumps at every completed step and phase, ``waiting`` what the main thread is
in: 0 the user's code, 1 a bounded wait on its peers or on the supervisor's plan, 2
the toolkit's own checkpoint I/O; ``state`` and ``cpu`` (utime + stime ticks) come
from ``/proc/PID/stat``. ``beat_t``, ``generation``, ``rank`` and ``compute_ms`` are
what the rank's heartbeat thread last wrote into its page (its heartbeat, folded into
the node's line: the supervisor reads no per-rank store key while this line comes;
``beat_t`` 0: none yet, ``rank`` -1: in no group, ``compute_ms`` -1: none measured).
After each line it sends, the pulse stamps ``relayed`` in every reported rank's page,
so the rank's heartbeat thread knows its beats reach the supervisor this way and
writes its store heartbeat only every few periods (the fallback should the pulse die).
Nothing here needs a rank's GIL or CPU share: a rank whose
main thread holds the GIL still has a pulse; a rank whose process is gone is reported
at once (its ``pidfd`` turns readable), a stopped one (``state`` T) within a period.
A rank that leaves cleanly removes its ``.rank`` file first and is dropped silently.

Peer probes (a node cut from its peers only, still reaching the supervisor and Slurm:
``supervisor/observe/partition.py``): the pulse answers probes on an endpoint of its
own, on the node's address (``SR_NODE_ADDR``, else the address its supervisor connection
leaves from), announced in every line as ``"probe": [addr, port]``. A probe proves the
job's secret (an HMAC of the token) and gets one byte back, so a port of another job
answers nothing. When the supervisor sends ``{"probe": {"id": n, "peers": {node: [addr,
port]}}}`` on the liveness connection, the pulse probes those peers at once, in
parallel, from the node's address, each with a ``PROBE_TIMEOUT_S`` deadline (a dropped
SYN gets no answer), and reports ``"reach": {"id": n, "ok": [...], "bad": [...]}``.

Plan notices (the plan fan-out at scale): when the supervisor publishes generation g's
plan it sends the pulse of every node in it ``{"plan": g, "body": <the plan>}`` (and
every pulse ``{"shutdown": 1}`` at the job's end); the pulse writes the plan into the
directory (``plan.{g}``) and then g into every rank's page (``TOLD``), so a rank that
waits for a plan or checks for one at a safe point reads its page, and then the plan
from the node's own memory, not the store: the supervisor sends N/G lines, instead of N
store checks every poll and N reads of the whole table (``worker/plan_watch.py``).

A link that stops taking lines (a flap) is replaced by a fresh connection as soon as
one connects, rather than waited out through TCP's retransmission back-off
(``pulse_link.py``).

When the supervisor restarts, its new liveness port is what the ranks' heartbeat
threads write into their pages; the pulse reconnects there. With no rank left for
``idle_exit_s`` it exits (a rank starting later starts a new one).
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import select
import socket
import struct
import sys
import time


__all__ = [
    "COMPUTING", "WAITING", "BUSY", "LAYOUT", "BEAT", "BEAT_AT", "RELAYED_AT", "RELAYED", "PAGE", "BOARD", "RANK",
    "LOCK", "NODE_ADDR_ENV", "read_board", "read_beat", "read_relayed", "proc_stat", "Watched", "scan", "fold",
    "stamp_relayed", "TOLD", "TOLD_AT", "read_told", "stamp_told", "tidy", "run", "main"
]


# A rank's page (little-endian): progress u64, waiting u32, liveness port u32, step u64;
# then the heartbeat: beat time f64, generation i32, rank i32, compute ms f64; then the
# time the pulse last relayed it, f64; then the supervisor's notices, newest plan generation
# told + 1 (0: none) i64 and the job's end (0/1) i64 (the last three written by the pulse only).
COMPUTING, WAITING, BUSY = 0, 1, 2  # values of ``waiting``
LAYOUT = struct.Struct("<QIIQ")
BEAT = struct.Struct("<diid")  # at BEAT_AT
BEAT_AT, RELAYED_AT = LAYOUT.size, LAYOUT.size + BEAT.size
RELAYED = struct.Struct("<d")
TOLD_AT = RELAYED_AT + RELAYED.size
TOLD = struct.Struct("<qq")
PAGE = 4096
BOARD, RANK, LOCK = ".board", ".rank", "pulse.lock"
NODE_ADDR_ENV = "SR_NODE_ADDR"


def _load(name: str):
    """``{name}.py`` beside this file, by path: ``python -I`` puts no package on sys.path."""
    spec = importlib.util.spec_from_file_location(f"sr_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer_probe, notices, pulse_link = _load("peer_probe"), _load("notices"), _load("pulse_link")


def read_board(page: mmap.mmap) -> tuple[int, int, int, int]:
    """(progress, waiting, port, step) as the rank last wrote them."""
    return LAYOUT.unpack_from(page, 0)


def read_beat(page: mmap.mmap) -> tuple[float, int, int, float]:
    """(beat time, generation, rank, compute ms) as the rank's heartbeat thread last wrote them."""
    return BEAT.unpack_from(page, BEAT_AT)


def read_relayed(page: mmap.mmap) -> float:
    """When the node's pulse last sent this rank's entry to the supervisor (0: never)."""
    return RELAYED.unpack_from(page, RELAYED_AT)[0]


def read_told(page: mmap.mmap) -> tuple[int, bool]:
    """(newest plan generation the supervisor has told the node of, -1: none; the job is over)."""
    gen, ended = TOLD.unpack_from(page, TOLD_AT)
    return gen - 1, bool(ended)


def stamp_told(ranks: dict[str, "Watched"], told) -> None:
    """Write the notices into every rank's page (idempotent: ranks that arrived later get them too)."""
    for r in ranks.values():
        TOLD.pack_into(r.page, TOLD_AT, told.generation + 1, int(told.ended))


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, utime + stime ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rindex(b")") + 2:].split()  # the command name may hold spaces and parens
    return rest[0].decode(), int(rest[11]) + int(rest[12])


class Watched:
    """One rank of the node: its page and a pidfd that turns readable when it exits."""

    def __init__(self, directory: str, worker_id: str, pid: int) -> None:
        self.worker_id, self.pid = worker_id, pid
        self.rank_path = os.path.join(directory, worker_id + RANK)
        self.board_path = os.path.join(directory, worker_id + BOARD)
        with open(self.board_path, "r+b") as f:
            self.page = mmap.mmap(f.fileno(), PAGE)
        try:
            self.pidfd: int | None = os.pidfd_open(pid)  # Linux >= 5.3
        except (AttributeError, OSError):
            self.pidfd = None

    def close(self) -> None:
        self.page.close()
        if self.pidfd is not None:
            os.close(self.pidfd)


def scan(directory: str, ranks: dict[str, Watched]) -> None:
    """Add the ranks that announced themselves since the last scan."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        wid = name[:-len(RANK)]
        if not name.endswith(RANK) or not wid or wid in ranks:
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                pid = int(json.load(f)["pid"])
            ranks[wid] = Watched(directory, wid, pid)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-announced or already gone: the next scan will tell


def fold(ranks: dict[str, Watched], ready: set[int]) -> tuple[dict[str, list], dict[str, int]]:
    """One look at every rank: (entries of the live ones, pids of those that died).
    A dead rank's files are removed; one that left cleanly (no ``.rank``) is dropped."""
    live: dict[str, list] = {}
    gone: dict[str, int] = {}
    for wid, r in list(ranks.items()):
        st = proc_stat(r.pid)
        announced = os.path.exists(r.rank_path)
        if r.pidfd in ready or st is None or st[0] in ("Z", "X") or not announced:
            if announced:
                gone[wid] = r.pid
                for path in (r.rank_path, r.board_path):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            r.close()
            del ranks[wid]
            continue
        progress, waiting, _, step = read_board(r.page)
        beat_t, generation, rank, compute_ms = read_beat(r.page)
        live[wid] = [r.pid, progress, waiting, step, st[0], st[1], round(beat_t, 3), generation, rank,
                     round(compute_ms, 3)]
    return live, gone


def stamp_relayed(ranks: dict[str, Watched], live: dict[str, list], t: float) -> None:
    """The line with these ranks went out: say so in each one's page."""
    for wid in live:
        r = ranks.get(wid)
        if r is not None:
            RELAYED.pack_into(r.page, RELAYED_AT, t)


def tidy(directory: str) -> bool:
    """No rank left: remove the node's pulse directory (the lock with it) and say so;
    False when a rank has just announced itself (the pulse stays)."""
    try:
        names = os.listdir(directory)
        if any(n.endswith(RANK) for n in names):
            return False
        for n in names:
            os.unlink(os.path.join(directory, n))
        os.rmdir(directory)
    except OSError:
        pass  # a rank is arriving (it recreates what it needs) or it is gone already
    return True


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _send(sock: socket.socket, msg: dict) -> bool:
    try:
        sock.sendall((json.dumps(msg, separators=(",", ":")) + "\n").encode())
        return True
    except (BlockingIOError, OSError):
        return False


def _ports(ranks: dict[str, Watched]) -> list[int]:
    """The liveness ports the ranks last wrote, newest-looking first (most common)."""
    seen: dict[int, int] = {}
    for r in ranks.values():
        port = read_board(r.page)[2]
        if port:
            seen[port] = seen.get(port, 0) + 1
    return sorted(seen, key=lambda p: -seen[p])


def run(*, directory: str, host: str, period: float, hello: dict, idle_exit_s: float = 3.0) -> int:
    """The pulse's loop: one line per ``period`` for the node's ranks; returns 0 once idle ``idle_exit_s``."""
    ranks: dict[str, Watched] = {}
    sock: socket.socket | None = None
    port = 0
    idle_since = time.monotonic()
    probe, source, inbox = peer_probe.PeerProbe(str(hello.get("token", ""))), os.environ.get(NODE_ADDR_ENV), b""
    told = notices.Told(directory)
    link = pulse_link.Link()
    next_line = 0.0
    while True:
        scan(directory, ranks)
        fds = [r.pidfd for r in ranks.values() if r.pidfd is not None]
        extra = probe.fds() + ([sock] if sock is not None else [])
        wait = max(0.0, min(next_line - time.monotonic(), link.retry_in(time.monotonic())))
        ready = set(select.select(fds + extra, [], [], wait)[0]) if fds or extra else (time.sleep(wait) or set())
        probe.serve(ready, time.monotonic())
        if sock is not None and sock in ready:
            asked, inbox = notices.messages(sock, inbox)
            for msg in asked if asked is not None else ():
                if isinstance(msg.get("probe"), dict):
                    probe.start(msg["probe"], source)
                if told.take(msg):
                    stamp_told(ranks, told)  # at once: ranks poll their pages for it
            if asked is None:  # the supervisor closed it: reconnect now, not at the next line
                sock.close()
                sock, next_line = None, 0.0
        reach = probe.take()
        if sock is not None and link.look(pulse_link.timed_out(sock), time.monotonic()):
            fresh = pulse_link.connect(host, port, hello, timeout=pulse_link.RETRY_S)
            if fresh is not None:  # the link is back: the line goes out on the new one now
                sock.close()
                sock, inbox, next_line = fresh, b"", 0.0
                link.swapped(time.monotonic())
        if time.monotonic() < next_line and reach is None and not any(fd in ready for fd in fds):
            continue
        next_line = time.monotonic() + period
        scan(directory, ranks)
        live, gone = fold(ranks, ready)
        stamp_told(ranks, told)  # ranks announced since the notice
        if ranks:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > idle_exit_s and not gone and tidy(directory):
            return 0
        if sock is None or _closed(sock):
            ports = _ports(ranks)
            new = next((p for p in ports if p != port), ports[0] if ports else 0)
            if sock is not None:
                sock.close()
                sock = None
                if new == port:
                    continue  # the supervisor is restarting; its new port is not known yet
            if not new:
                continue
            port, sock, inbox = new, pulse_link.connect(host, new, hello), b""
            if sock is None:
                continue
            probe.listen(source or sock.getsockname()[0])
        t = time.time()
        line = {"t": t, "ranks": live, "gone": gone}
        if probe.endpoint is not None:
            line["probe"] = probe.endpoint
        if reach is not None:
            line["reach"] = reach
        if _send(sock, line):
            stamp_relayed(ranks, live, t)
        else:
            sock.close()
            sock = None


def main() -> int:
    """``python -I pulse.py``: :func:`run` with the settings of the JSON line on stdin."""
    cfg = json.loads(sys.stdin.readline())
    sys.stdin.close()
    return run(directory=str(cfg["dir"]), host=str(cfg["host"]), period=float(cfg["period"]),
               hello=dict(cfg["hello"]), idle_exit_s=float(cfg.get("idle_exit_s", 3.0)))


if __name__ == "__main__":
    sys.exit(main())
