"""Peer probes between node pulses: is a node cut from its peers only?

Standard library only: loaded by ``pulse.py`` (``python -I``, no package import) and
importable from the package for tests. A pulse answers probes on an endpoint of its own
(:class:`PeerProbe`); a probe proves the job's secret (an HMAC of the token, never the
token) and gets one byte back, so a port of another job answers nothing. A probe is a
connect from the node's own address with a ``PROBE_TIMEOUT_S`` deadline: a dropped SYN
(a partition, a powered-off peer) is an answer of "unreachable" after it, not a hang.
The supervisor decides what the answers mean (``supervisor/observe/partition.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import threading


__all__ = ["PROBE_TIMEOUT_S", "probe_digest", "reach_one", "PeerProbe"]


PROBE_TIMEOUT_S = 0.5  # one peer probe: connect, prove the secret, one byte back


def probe_digest(token: str) -> bytes:
    """What a probe sends: proof of the job's secret, not the secret."""
    return hmac.new(str(token).encode(), b"sr-peer-probe", hashlib.sha256).hexdigest().encode() + b"\n"


def reach_one(addr: str, port: int, source: str | None, digest: bytes, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when the path to the peer's pulse at ``addr:port`` works both ways.

    The connect's handshake is the network's answer (a SYN and its SYN-ACK crossed):
    no connect within ``timeout`` is False. The peer's one byte proves it is this job's
    pulse: a wrong answer or a close without one (another listener on that port) is
    False; no answer in time is True (a CPU-starved pulse, not a cut link)."""
    try:
        s = socket.create_connection((addr, port), timeout=timeout, source_address=(source, 0) if source else None)
    except OSError:
        return False
    with s:
        try:
            s.sendall(digest)
            return s.recv(1) == b"1"
        except socket.timeout:
            return True
        except OSError:
            return False


class PeerProbe:
    """The node's probe endpoint (answers its peers) and its own probes of them."""

    def __init__(self, token: str) -> None:
        self.digest = probe_digest(token)
        self.listener: socket.socket | None = None
        self.endpoint: list | None = None  # [addr, port] once listening
        self._conns: dict[socket.socket, tuple[float, bytes]] = {}
        self._lock = threading.Lock()
        self._result: dict | None = None

    def listen(self, addr: str) -> None:
        if self.listener is not None:
            return
        try:
            self.listener = socket.create_server((addr, 0), backlog=64)
        except OSError:
            return  # no endpoint: this node is never probed (the supervisor blames no one for it)
        self.listener.setblocking(False)
        self.endpoint = [addr, self.listener.getsockname()[1]]

    def fds(self) -> list:
        return ([self.listener] if self.listener is not None else []) + list(self._conns)

    def serve(self, ready: set, now: float) -> None:
        """Accept probes and answer those that prove the secret; drop the slow or wrong."""
        if self.listener is not None and self.listener in ready:
            try:
                conn, _ = self.listener.accept()
                conn.setblocking(False)
                self._conns[conn] = (now, b"")
            except OSError:
                pass
        for conn in [c for c in self._conns if c in ready]:
            t0, buf = self._conns[conn]
            try:
                buf += conn.recv(128)
            except BlockingIOError:
                continue
            except OSError:
                buf = b"x" * 256
            if buf == self.digest:
                try:
                    conn.send(b"1")
                except OSError:
                    pass
            elif len(buf) < len(self.digest) and self.digest.startswith(buf) and buf:
                self._conns[conn] = (t0, buf)
                continue
            conn.close()
            del self._conns[conn]
        for conn in [c for c, (t0, _) in self._conns.items() if now - t0 > 2 * PROBE_TIMEOUT_S]:
            conn.close()
            del self._conns[conn]

    def start(self, request: dict, source: str | None) -> None:
        """Probe the request's peers in parallel (threads), off the pulse's loop."""
        peers = {str(n): (str(a), int(p)) for n, (a, p) in dict(request["peers"]).items()}
        rid = int(request["id"])

        def run() -> None:
            out: dict[str, bool] = {}
            ths = [threading.Thread(target=lambda n=n, a=a: out.__setitem__(n, reach_one(a[0], a[1], source, self.digest)),
                                    daemon=True) for n, a in peers.items()]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            with self._lock:
                self._result = {"id": rid, "ok": sorted(n for n, v in out.items() if v),
                                "bad": sorted(n for n, v in out.items() if not v)}

        threading.Thread(target=run, name="sr-peer-probe", daemon=True).start()

    def take(self) -> dict | None:
        with self._lock:
            out, self._result = self._result, None
        return out
