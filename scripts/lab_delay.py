#!/usr/bin/env python3
"""Hold every packet of one lab node for a fixed time: the lab's `delay-node` fault.

This kernel has no `netem`, so a fixed delay is made in user space: the lab's iptables
rule (`lab_net.delay_rules`) hands the node's packets to an NFQUEUE queue, and this
process, bound to that queue, gives each packet its ACCEPT verdict DELAY_MS after it
arrived (one delay for all packets: their order is kept). Every packet to and from
the node passes once, so a round trip with the node takes 2 x DELAY_MS longer. The
rule has `--queue-bypass`: with this process gone, packets pass undelayed, never
dropped. Stdlib only (netlink through `socket`); needs root, like the lab's other
network faults.

    lab_delay.py --queue N --delay-ms D     prints "ready" once bound; SIGTERM ends it
"""

from __future__ import annotations

import argparse
import collections
import errno
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = 0, 1, 2
CMD_BIND, CMD_UNBIND = 1, 2
CFG_CMD, CFG_PARAMS = 1, 2
PACKET_HDR, VERDICT_HDR = 1, 2
COPY_META = 1  # the kernel sends the packet's id and headers, not its payload
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1


class QueueError(Exception):
    """The queue could not be bound (not root, no nfnetlink_queue, queue taken)."""


class Queue:
    """One NFQUEUE queue over a netlink socket: packets in, verdicts out."""

    def __init__(self, number: int) -> None:
        self.number, self._seq = number, 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))
        self._ask(CFG_CMD, struct.pack("BxH", CMD_BIND, socket.htons(socket.AF_INET)))
        self._ask(CFG_PARAMS, struct.pack(">IB", 0, COPY_META))

    def _message(self, kind: int, attrs: list[tuple[int, bytes]], flags: int) -> bytes:
        self._seq += 1
        body = struct.pack("BBH", socket.AF_UNSPEC, 0, socket.htons(self.number))
        for atype, payload in attrs:
            size = 4 + len(payload)
            body += struct.pack("HH", size, atype) + payload + b"\0" * (-size % 4)
        return struct.pack("IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, self._seq, 0) + body

    def _ask(self, attr: int, payload: bytes) -> None:
        """A config request and its acknowledgement (an error number 0, or why not)."""
        self.sock.send(self._message(MSG_CONFIG, [(attr, payload)], NLM_F_REQUEST | NLM_F_ACK))
        reply = self.sock.recv(4096)
        _, kind = struct.unpack("IH", reply[:6])
        if kind == NLMSG_ERROR and struct.unpack("i", reply[16:20])[0] != 0:
            raise QueueError(f"queue {self.number}: netlink error {-struct.unpack('i', reply[16:20])[0]}")

    def packets(self) -> list[int]:
        """The ids of the packets waiting in the socket now (non-blocking)."""
        ids = []
        while True:
            try:
                data = self.sock.recv(65535, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return ids
            except OSError as e:  # ENOBUFS: the kernel dropped what did not fit; go on
                if e.errno != errno.ENOBUFS:
                    raise
                continue
            off = 0
            while off + 16 <= len(data):
                size, kind = struct.unpack("IH", data[off:off + 6])
                if size < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET:
                    ids += _packet_ids(data[off + 20:off + size])
                off += (size + 3) & ~3

    def accept(self, packet_id: int) -> None:
        self.sock.send(self._message(MSG_VERDICT, [(VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))],
                                     NLM_F_REQUEST))

    def close(self) -> None:
        try:
            self._ask(CFG_CMD, struct.pack("BxH", CMD_UNBIND, socket.htons(socket.AF_INET)))
        except (OSError, QueueError):
            pass
        self.sock.close()


def _packet_ids(attrs: bytes) -> list[int]:
    off, out = 0, []
    while off + 4 <= len(attrs):
        size, atype = struct.unpack("HH", attrs[off:off + 4])
        if size < 4:
            break
        if atype & 0x7FFF == PACKET_HDR:
            out.append(struct.unpack(">I", attrs[off + 4:off + 8])[0])
        off += (size + 3) & ~3
    return out


def serve(queue: Queue, delay_s: float, stop: list[bool]) -> None:
    """Accept each packet ``delay_s`` after it arrived, until ``stop[0]``; then the rest at once."""
    held: collections.deque[tuple[float, int]] = collections.deque()
    while not stop[0]:
        now = time.monotonic()
        while held and held[0][0] <= now:
            queue.accept(held.popleft()[1])
        wait = max(0.0, held[0][0] - now) if held else 0.5
        ready, _, _ = select.select([queue.sock], [], [], wait)
        if ready:
            arrived = time.monotonic()
            held.extend((arrived + delay_s, pid) for pid in queue.packets())
    for _, pid in held:
        queue.accept(pid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queue", type=int, required=True, help="NFQUEUE queue number (0..65535)")
    ap.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held (ms, > 0)")
    args = ap.parse_args(argv)
    if not 0 <= args.queue <= 65535 or not 0 < args.delay_ms <= 10000:
        print("lab_delay: --queue must be 0..65535 and --delay-ms in (0, 10000]", file=sys.stderr)
        return 2
    try:
        queue = Queue(args.queue)
    except (OSError, QueueError) as e:
        print(f"lab_delay: cannot bind NFQUEUE {args.queue}: {e}", file=sys.stderr)
        return 1
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__(0, True))
    print("ready", flush=True)
    try:
        serve(queue, args.delay_ms / 1000.0, stop)
    finally:
        queue.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
