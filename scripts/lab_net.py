"""Per-node addresses and network faults for scripts/local-cluster.

Every emulated node nI has its own loopback address, 127.0.0.(10+I): slurmctld
reaches its slurmd there (NodeAddr), and the node's ranks bind their gloo pairs to
it (SR_NODE_ADDR, set for every task by the lab's TaskProlog). Lab traffic never
leaves 127.0.0.0/8.

A loopback socket that connects without bind() gets source 127.0.0.1 whatever node
it belongs to, so addresses alone cannot say which node sent a packet. Each node's
slurmd therefore starts in a cgroup v2 directory of its own
(``/sys/fs/cgroup/unified/sr-lab/nI``); slurmstepd and every task inherit it (the
v1 plugins of Slurm never move a process in the v2 tree). A permanent rule marks
every connection a node's process sends on with the node's bit (conntrack mark,
``iptables -m cgroup --path``), so a fault rule matching that bit drops both
directions of every connection the node ever took part in, and a rule on the
node's address drops new connections to it (its slurmd, its gloo listeners).

Two chains of the filter table, both reached from OUTPUT (every loopback packet
passes OUTPUT once, on the sending side):

- ``SR_LAB_MARK``: the marks, installed by ``start``, removed by ``stop``;
- ``SR_LAB``: the faults, each rule tagged with a comment ``sr-lab NODE FAULT``;
  ``heal NODE`` deletes the node's rules, ``reset`` flushes the chain.

A slow node (``slow-node NODE RATE``: a link that negotiated down, a congested port)
is shaped, not dropped: an htb qdisc on ``lo`` (no ``netem`` on every kernel, so no
fixed added delay) with a class of RATE per slow node, and rules in the mangle table's
``SR_LAB_SLOW`` chain (from POSTROUTING, after the marks are set) that put every packet
of the node's connections into its class (``CLASSIFY``); everything else passes
unshaped. Healing the last slow node removes the qdisc.

A delayed node (``delay-node NODE MS``: a long or congested path) has its packets
handed by two ``SR_LAB`` rules to an NFQUEUE queue of its own (:func:`delay_queue`),
where ``scripts/lab_delay.py`` holds each MS before accepting it (no ``netem`` on
every kernel: this is the fixed delay it would add); ``--queue-bypass`` lets packets
through undelayed if that process is gone.

Nodes n1..n32 have a bit each (the conntrack mark has 32); larger labs get
addresses for every node but network faults only on the first 32.

The rule builders here are pure (argv lists); ``apply`` runs them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

CGROUP2 = "/sys/fs/cgroup/unified"  # the hybrid layout's v2 mount (cgroup v1 boxes)
CGROUP_DIR = "sr-lab"
MARK_CHAIN = "SR_LAB_MARK"
FAULT_CHAIN = "SR_LAB"
FIRST_HOST = 10  # n1 -> 127.0.0.11
MAX_FAULT_NODES = 32
SLOW_CHAIN = "SR_LAB_SLOW"  # mangle table: which packets go to a slow node's class
SLOW_QDISC = "1:"  # htb on lo while a node is slow; unclassified packets pass unshaped (default 0)
FAULTS = ("partition-node", "partition-peers", "partition-supervisor", "lossy-node", "slow-node", "delay-node")
DELAY_QUEUE_BASE = 4700  # NFQUEUE queue of a delayed node: base + its index (scripts/lab_delay.py)


class NetError(Exception):
    """A network fault cannot be made (one line for the user)."""


def node_index(node: str) -> int:
    m = re.fullmatch(r"n(\d+)", node)
    if not m or int(m.group(1)) < 1:
        raise NetError(f"not a lab node name: {node!r}")
    return int(m.group(1))


def node_addr(node: str) -> str:
    """The node's own loopback address: n1 -> 127.0.0.11."""
    i = node_index(node)
    if FIRST_HOST + i > 254:
        raise NetError(f"{node}: no loopback address (at most {254 - FIRST_HOST} nodes)")
    return f"127.0.0.{FIRST_HOST + i}"


def node_bit(node: str) -> int:
    """The node's bit of the conntrack mark."""
    i = node_index(node)
    if i > MAX_FAULT_NODES:
        raise NetError(f"{node}: network faults only on n1..n{MAX_FAULT_NODES} (one conntrack mark bit each)")
    return 1 << (i - 1)


def cgroup_path(node: str) -> str:
    """The node's cgroup, relative to the v2 root (what ``-m cgroup --path`` takes)."""
    return f"{CGROUP_DIR}/{node}"


def _mark(bits: int) -> str:
    return f"0x{bits:x}/0x{bits:x}"


def _tag(node: str, fault: str) -> list[str]:
    return ["-m", "comment", "--comment", f"sr-lab {node} {fault}"]


def setup_rules(nodes: list[str]) -> list[list[str]]:
    """The chains, the jumps from OUTPUT and one mark rule per node (idempotent when
    run after :func:`teardown_rules`)."""
    rules = [["iptables", "-N", MARK_CHAIN], ["iptables", "-N", FAULT_CHAIN],
             ["iptables", "-I", "OUTPUT", "1", "-j", FAULT_CHAIN],
             ["iptables", "-I", "OUTPUT", "1", "-j", MARK_CHAIN]]
    for node in nodes:
        if node_index(node) <= MAX_FAULT_NODES:
            rules.append(["iptables", "-A", MARK_CHAIN, "-m", "cgroup", "--path", cgroup_path(node),
                          "-j", "CONNMARK", "--or-mark", hex(node_bit(node))])
    return rules


def teardown_rules() -> list[list[str]]:
    """Undo :func:`setup_rules` and every fault (each may fail: nothing there)."""
    return [["iptables", "-D", "OUTPUT", "-j", MARK_CHAIN], ["iptables", "-D", "OUTPUT", "-j", FAULT_CHAIN],
            ["iptables", "-F", MARK_CHAIN], ["iptables", "-X", MARK_CHAIN],
            ["iptables", "-F", FAULT_CHAIN], ["iptables", "-X", FAULT_CHAIN],
            ["iptables", "-t", "mangle", "-D", "POSTROUTING", "-j", SLOW_CHAIN],
            ["iptables", "-t", "mangle", "-F", SLOW_CHAIN], ["iptables", "-t", "mangle", "-X", SLOW_CHAIN],
            unshape_rule()]


def slow_chain_rules() -> list[list[str]]:
    """Create the mangle chain and its jump (run with check=False: either may exist)."""
    return [["iptables", "-t", "mangle", "-N", SLOW_CHAIN],
            ["iptables", "-t", "mangle", "-I", "POSTROUTING", "1", "-j", SLOW_CHAIN]]


def slow_rules(node: str, rate: str, *, shaped: bool) -> list[list[str]]:
    """Shape every connection of ``node`` to ``rate`` (tc units: 800kbit, 2mbit, ...);
    ``shaped``: the htb qdisc is on ``lo`` already (another slow node)."""
    if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)", rate) or float(re.match(r"[\d.]+", rate).group()) <= 0:
        raise NetError(f"slow-node RATE must be a tc rate above 0 such as 800kbit or 2mbit, not {rate!r}")
    cls = f"{SLOW_QDISC}{node_index(node) + FIRST_HOST:x}"
    base = ["iptables", "-t", "mangle", "-A", SLOW_CHAIN, *_tag(node, "slow-node")]
    rules = [] if shaped else [["tc", "qdisc", "add", "dev", "lo", "root", "handle", SLOW_QDISC, "htb", "default", "0"]]
    return rules + [
        ["tc", "class", "replace", "dev", "lo", "parent", SLOW_QDISC, "classid", cls, "htb", "rate", rate,
         "ceil", rate],
        [*base, "-m", "connmark", "--mark", _mark(node_bit(node)), "-j", "CLASSIFY", "--set-class", cls],
        [*base, "-d", node_addr(node), "-j", "CLASSIFY", "--set-class", cls]]


def unshape_rule() -> list[str]:
    """Remove the htb qdisc from ``lo`` (its classes go with it)."""
    return ["tc", "qdisc", "del", "dev", "lo", "root", "handle", SLOW_QDISC]


def delay_queue(node: str) -> int:
    """The NFQUEUE queue number of ``node``'s delay (its ``lab_delay.py`` binds it)."""
    return DELAY_QUEUE_BASE + node_index(node)


def delay_rules(node: str) -> list[list[str]]:
    """Hand every packet of ``node`` (its connections, and new ones to its address) to its
    NFQUEUE queue, where ``lab_delay.py`` holds it; ``--queue-bypass``: with no process
    bound to the queue the packets pass undelayed, never dropped."""
    queue = ["-j", "NFQUEUE", "--queue-num", str(delay_queue(node)), "--queue-bypass"]
    base = ["iptables", "-A", FAULT_CHAIN, *_tag(node, "delay-node")]
    return [[*base, "-m", "connmark", "--mark", _mark(node_bit(node)), *queue],
            [*base, "-d", node_addr(node), *queue]]


def _cut(node: str, fault: str, extra: list[str]) -> list[list[str]]:
    """Drop everything of ``node``: its connections (mark) and new ones to its address."""
    base = ["iptables", "-A", FAULT_CHAIN, *_tag(node, fault)]
    return [[*base, "-m", "connmark", "--mark", _mark(node_bit(node)), *extra, "-j", "DROP"],
            [*base, "-d", node_addr(node), *extra, "-j", "DROP"]]


def partition_rules(node: str) -> list[list[str]]:
    """``node`` reaches no one and no one reaches it (slurmctld included)."""
    return _cut(node, "partition-node", [])


def lossy_rules(node: str, probability: float) -> list[list[str]]:
    """Each packet to or from ``node`` is dropped with ``probability`` (0 < p < 1)."""
    if not 0 < probability < 1:
        raise NetError(f"loss probability must be in (0, 1), not {probability}")
    return _cut(node, "lossy-node", ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.4f}"])


def peers_rules(node: str, peers: list[str]) -> list[list[str]]:
    """``node`` and each of ``peers`` cannot reach each other; both still reach
    everyone else (slurmctld, the supervisor's node when it is not among ``peers``)."""
    if not peers or node in peers:
        raise NetError("partition-peers needs other nodes to cut the node from")
    rules = []
    base = ["iptables", "-A", FAULT_CHAIN, *_tag(node, "partition-peers")]
    for peer in peers:
        both = node_bit(node) | node_bit(peer)
        rules += [[*base, "-m", "connmark", "--mark", _mark(both), "-j", "DROP"],
                  [*base, "-m", "connmark", "--mark", _mark(node_bit(node)), "-d", node_addr(peer), "-j", "DROP"],
                  [*base, "-m", "connmark", "--mark", _mark(node_bit(peer)), "-d", node_addr(node), "-j", "DROP"]]
    return rules


def supervisor_rules(node: str, sup_addr: str, ports: list[int]) -> list[list[str]]:
    """The reverse of :func:`peers_rules`: ``node`` cannot reach the supervisor's
    servers (``ports`` on ``sup_addr``), whose answers are dropped too; its peers (the
    ranks on the supervisor's node included) and slurmctld still reach it."""
    if not re.fullmatch(r"127\.\d{1,3}\.\d{1,3}\.\d{1,3}", sup_addr):
        raise NetError(f"the supervisor's address must be a lab address in 127.0.0.0/8, not {sup_addr!r}")
    if not ports or any(not 0 < p < 65536 for p in ports):
        raise NetError(f"partition-supervisor needs the supervisor's ports, not {ports}")
    base = ["iptables", "-A", FAULT_CHAIN, *_tag(node, "partition-supervisor")]
    bit = _mark(node_bit(node))
    plist = ",".join(str(p) for p in ports)
    return [[*base, "-m", "connmark", "--mark", bit, "-d", sup_addr, "-p", "tcp", "-m", "multiport",
             "--dports", plist, "-j", "DROP"],
            [*base, "-m", "connmark", "--mark", bit, "-s", sup_addr, "-p", "tcp", "-m", "multiport",
             "--sports", plist, "-j", "DROP"]]


def heal_rules(listing: str, node: str | None = None, *, slow: str = "") -> list[list[str]]:
    """The deletions that remove ``node``'s fault rules (every node's when None), from
    ``iptables -S SR_LAB`` output, and from ``iptables -t mangle -S SR_LAB_SLOW`` output
    (``slow``); with no slow node left after them, the htb qdisc goes too."""
    out = []
    for chain, text, table in ((FAULT_CHAIN, listing, []), (SLOW_CHAIN, slow, ["-t", "mangle"])):
        for line in text.splitlines():
            words = shlex.split(line)
            if len(words) < 3 or words[:2] != ["-A", chain]:
                continue
            m = re.search(r"sr-lab (\S+) ", line)
            if m and (node is None or m.group(1) == node):
                out.append(["iptables", *table, "-D", *words[1:]])
    left = [ln for ln in slow.splitlines() if ln.startswith(f"-A {SLOW_CHAIN} ")]
    removed = sum(1 for r in out if r[1:3] == ["-t", "mangle"])
    if left and removed == len(left):
        out.append(unshape_rule())
    return out


# ------------------------------------------------------------------- executor


def apply(rules: list[list[str]], check: bool = True) -> None:
    """Run each argv; the first failure raises :class:`NetError` (when ``check``)."""
    for argv in rules:
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=15)
        except FileNotFoundError:
            raise NetError("iptables not installed: network faults need it") from None
        if check and res.returncode != 0:
            raise NetError(f"{' '.join(argv)}: {res.stderr.strip() or res.returncode}")


def listing() -> str:
    res = subprocess.run(["iptables", "-S", FAULT_CHAIN], capture_output=True, text=True, timeout=15)
    if res.returncode != 0:
        raise NetError("no SR_LAB chain: start the lab (scripts/local-cluster start) first")
    return res.stdout


def slow_listing() -> str:
    """The slow nodes' rules ("" when there is no such chain yet)."""
    res = subprocess.run(["iptables", "-t", "mangle", "-S", SLOW_CHAIN], capture_output=True, text=True, timeout=15)
    return res.stdout if res.returncode == 0 else ""


def has_cgroup2() -> bool:
    return os.path.isfile(os.path.join(CGROUP2, "cgroup.procs")) and os.access(CGROUP2, os.W_OK)


def node_cgroup(node: str) -> str:
    """Create (if needed) and return the node's cgroup v2 directory."""
    path = os.path.join(CGROUP2, cgroup_path(node))
    os.makedirs(path, exist_ok=True)
    return path


def enter_cgroup(path: str) -> None:
    """Move the calling process into ``path`` (a preexec_fn: its children follow)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def task_prolog(nodes: list[str]) -> str:
    """A TaskProlog that exports the task's node address (SR_NODE_ADDR)."""
    cases = "".join(f"  {n}) echo export SR_NODE_ADDR={node_addr(n)} ;;\n" for n in nodes)
    return f'#!/bin/sh\n# Generated by scripts/local-cluster.\ncase "$SLURMD_NODENAME" in\n{cases}esac\n'
