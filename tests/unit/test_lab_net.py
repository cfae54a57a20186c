"""The local cluster's network faults: node addresses, the pure iptables rule builders
(scripts/lab_net.py), healing from a chain listing, and which lab command
``slurm-resilience inject`` runs for each network fault (``inject.network_args``)."""

import importlib.util
from pathlib import Path

import pytest

from slurm_resilience.errors import ResilienceError
from slurm_resilience.inject import FAULTS, NETWORK_FAULTS, network_args

_spec = importlib.util.spec_from_file_location(
    "lab_net", Path(__file__).resolve().parents[2] / "scripts" / "lab_net.py")
lab_net = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab_net)


def _words(rules):
    return [" ".join(r) for r in rules]


def test_every_node_has_its_own_loopback_address():
    addrs = [lab_net.node_addr(f"n{i}") for i in range(1, 65)]
    assert addrs[0] == "127.0.0.11" and addrs[5] == "127.0.0.16"
    assert len(set(addrs)) == 64 and all(a.startswith("127.0.0.") for a in addrs)
    for bad in ("node1", "n0", "n", "x1"):
        with pytest.raises(lab_net.NetError):
            lab_net.node_addr(bad)


def test_mark_bits_are_distinct_and_stop_at_32():
    bits = [lab_net.node_bit(f"n{i}") for i in range(1, 33)]
    assert len(set(bits)) == 32 and all(b & (b - 1) == 0 for b in bits)
    with pytest.raises(lab_net.NetError, match="n1..n32"):
        lab_net.node_bit("n33")


def test_setup_marks_each_nodes_connections_and_teardown_undoes_it():
    rules = lab_net.setup_rules(["n1", "n2", "n40"])
    text = _words(rules)
    assert "iptables -I OUTPUT 1 -j SR_LAB_MARK" in text and "iptables -I OUTPUT 1 -j SR_LAB" in text
    marks = [r for r in rules if "CONNMARK" in r]
    assert [r[r.index("--path") + 1] for r in marks] == ["sr-lab/n1", "sr-lab/n2"]  # n40: no bit
    assert [r[-1] for r in marks] == ["0x1", "0x2"]
    down = _words(lab_net.teardown_rules())
    assert "iptables -D OUTPUT -j SR_LAB_MARK" in down and "iptables -X SR_LAB" in down
    # the marks are installed before any fault rule can see a packet
    assert text.index("iptables -I OUTPUT 1 -j SR_LAB_MARK") > text.index("iptables -I OUTPUT 1 -j SR_LAB")


def test_slow_node_shapes_its_connections_in_a_class_of_its_own_and_the_last_heal_unshapes():
    rules = lab_net.slow_rules("n3", "2mbit", shaped=False)
    text = _words(rules)
    assert text[0] == "tc qdisc add dev lo root handle 1: htb default 0"  # unclassified: unshaped
    assert "tc class replace dev lo parent 1: classid 1:d htb rate 2mbit ceil 2mbit" in text
    marks = [r for r in rules if "CLASSIFY" in r]
    assert len(marks) == 2 and all(r[:5] == ["iptables", "-t", "mangle", "-A", "SR_LAB_SLOW"] for r in marks)
    assert any("--mark 0x4/0x4" in t for t in text) and any("-d 127.0.0.13" in t for t in text)
    assert lab_net.slow_rules("n4", "2mbit", shaped=True)[0][:2] == ["tc", "class"]  # the qdisc is there
    for bad in ("2", "fast", "0kbit", "2mbps"):
        with pytest.raises(lab_net.NetError, match="RATE"):
            lab_net.slow_rules("n3", bad, shaped=False)
    listing = "\n".join(["-N SR_LAB_SLOW"] + [
        f'-A SR_LAB_SLOW -m comment --comment "sr-lab {n} slow-node" -j CLASSIFY --set-class 0001:000{i}'
        for n, i in (("n3", "d"), ("n4", "e"))])
    one = _words(lab_net.heal_rules("-N SR_LAB", "n3", slow=listing))
    assert one == ['iptables -t mangle -D SR_LAB_SLOW -m comment --comment sr-lab n3 slow-node -j CLASSIFY '
                   '--set-class 0001:000d']  # n4 is still slow: the qdisc stays
    every = _words(lab_net.heal_rules("-N SR_LAB", None, slow=listing))
    assert len(every) == 3 and every[-1] == "tc qdisc del dev lo root handle 1:"
    assert "tc qdisc del dev lo root handle 1:" in _words(lab_net.teardown_rules())


def test_partition_drops_the_nodes_connections_and_new_ones_to_its_address():
    rules = lab_net.partition_rules("n3")
    assert all(r[:3] == ["iptables", "-A", "SR_LAB"] and r[-2:] == ["-j", "DROP"] for r in rules)
    assert all("sr-lab n3 partition-node" in r for r in rules)
    text = _words(rules)
    assert any("--mark 0x4/0x4" in t for t in text)
    assert any("-d 127.0.0.13" in t for t in text)


def test_lossy_adds_a_probability_and_refuses_nonsense():
    rules = lab_net.lossy_rules("n2", 0.1)
    assert all(r[r.index("--probability") + 1] == "0.1000" for r in rules)
    for p in (0, 1, -0.5, 2):
        with pytest.raises(lab_net.NetError):
            lab_net.lossy_rules("n2", p)


def test_peers_cut_only_the_pairs_named():
    text = _words(lab_net.peers_rules("n2", ["n1", "n3"]))
    assert any("--mark 0x3/0x3" in t for t in text) and any("--mark 0x6/0x6" in t for t in text)
    assert any("--mark 0x2/0x2 -d 127.0.0.11" in t for t in text)
    assert any("--mark 0x1/0x1 -d 127.0.0.12" in t for t in text)
    assert not any("127.0.0.14" in t or "0x8" in t for t in text)  # n4 untouched
    assert all("connmark" in t for t in text)  # only the pairs' connections: not a whole partition
    for peers in ([], ["n2"]):
        with pytest.raises(lab_net.NetError):
            lab_net.peers_rules("n2", peers)


def test_supervisor_cut_names_its_ports_only():
    text = _words(lab_net.supervisor_rules("n2", "127.0.0.11", [40001, 40002]))
    assert len(text) == 2 and all("--mark 0x2/0x2" in t and "40001,40002" in t for t in text)
    assert "-d 127.0.0.11" in text[0] and "-s 127.0.0.11" in text[1]
    with pytest.raises(lab_net.NetError, match="127.0.0.0/8"):
        lab_net.supervisor_rules("n2", "10.0.0.1", [1])
    with pytest.raises(lab_net.NetError):
        lab_net.supervisor_rules("n2", "127.0.0.11", [])


LISTING = """-N SR_LAB
-A SR_LAB -m comment --comment "sr-lab n2 partition-node" -m connmark --mark 0x2/0x2 -j DROP
-A SR_LAB -d 127.0.0.12/32 -m comment --comment "sr-lab n2 partition-node" -j DROP
-A SR_LAB -m comment --comment "sr-lab n3 lossy-node" -m connmark --mark 0x4/0x4 -m statistic --mode random --probability 0.10000000009 -j DROP
"""


def test_delay_queues_the_nodes_packets_to_its_own_queue_and_never_drops_them():
    rules = lab_net.delay_rules("n3")
    q = str(lab_net.delay_queue("n3"))
    assert q != str(lab_net.delay_queue("n4"))
    assert all(r[:4] == ["iptables", "-A", "SR_LAB", "-m"] and r[-5:] == ["-j", "NFQUEUE", "--queue-num", q,
                                                                       "--queue-bypass"] for r in rules)
    assert [r[r.index("--comment") + 1] for r in rules] == ["sr-lab n3 delay-node"] * 2  # heal finds them
    assert "--mark" in rules[0] and rules[1][rules[1].index("-d") + 1] == "127.0.0.13"


def test_heal_deletes_the_listed_rules_of_the_node_or_of_all():
    one = lab_net.heal_rules(LISTING, "n2")
    assert len(one) == 2 and all(r[:3] == ["iptables", "-D", "SR_LAB"] for r in one)
    assert one[0][one[0].index("--comment") + 1] == "sr-lab n2 partition-node"  # quotes gone
    assert len(lab_net.heal_rules(LISTING, None)) == 3
    assert lab_net.heal_rules(LISTING, "n5") == []
    assert lab_net.heal_rules("-N SR_LAB\n", None) == []


def test_task_prolog_exports_the_node_address():
    text = lab_net.task_prolog(["n1", "n2"])
    assert "n1) echo export SR_NODE_ADDR=127.0.0.11 ;;" in text
    assert "n2) echo export SR_NODE_ADDR=127.0.0.12 ;;" in text and text.startswith("#!/bin/sh")


STATUS = {"ranks": [{"rank": 0, "node": "n1", "pid": 10}, {"rank": 1, "node": "n2", "pid": 11},
                    {"rank": 2, "node": "n3", "pid": 12}],
          "endpoints": {"host": "127.0.0.11", "store_port": 40001, "liveness_port": 40002}}


def _args(fault, **kw):
    kw = {"rank": 1, "seconds": 1.5, "probability": 0.1, **kw}
    return network_args(fault, STATUS, **kw)


def test_inject_network_faults_name_the_ranks_node():
    assert set(NETWORK_FAULTS) <= set(FAULTS)
    assert _args("partition-node") == ("n2", ["partition-node", "n2"])
    assert _args("partition-peers") == ("n2", ["partition-peers", "n2", "--peers", "n1,n3"])
    assert _args("partition-supervisor") == ("n2", ["partition-supervisor", "n2", "--supervisor-addr",
                                                    "127.0.0.11", "--ports", "40001,40002"])
    assert _args("flap-node") == ("n2", ["flap-node", "n2", "1.5"])
    assert _args("lossy-node", rank=2) == ("n3", ["lossy-node", "n3", "0.1"])
    assert _args("slow-node", rate="800kbit") == ("n2", ["slow-node", "n2", "800kbit"])
    assert _args("delay-node", delay_ms=25) == ("n2", ["delay-node", "n2", "25"])
    assert _args("heal") == ("", ["heal"])


def test_inject_network_faults_refuse_bad_input():
    with pytest.raises(ResilienceError, match="does not exist"):
        _args("partition-node", rank=7)
    with pytest.raises(ResilienceError, match="--seconds"):
        _args("flap-node", seconds=0)
    with pytest.raises(ResilienceError, match="--probability"):
        _args("lossy-node", probability=1.5)
    for bad in ("fast", "0mbit", "2 mbit", "-1kbit"):
        with pytest.raises(ResilienceError, match="--rate"):
            _args("slow-node", rate=bad)
    for bad in (0, -5, 20000):
        with pytest.raises(ResilienceError, match="--delay-ms"):
            _args("delay-node", delay_ms=bad)
    with pytest.raises(ResilienceError, match="endpoints"):
        network_args("partition-supervisor", {**STATUS, "endpoints": {}}, rank=1, seconds=1, probability=0.1)
    one_node = {"ranks": [{"rank": 0, "node": "n1", "pid": 1}, {"rank": 1, "node": "n1", "pid": 2}]}
    with pytest.raises(ResilienceError, match="no peer node"):
        network_args("partition-peers", one_node, rank=1, seconds=1, probability=0.1)
