"""A node cut from its peers only (supervisor/observe/partition.py, worker/peer_probe.py):
the blame rule and the probe plan as pure functions, the watch with an injected link and
clock, and real pulses probing each other through the real liveness server."""

import os
import queue
import socket
import subprocess
import sys
import time

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.model import FaultKind
from slurm_resilience.supervisor.decide.classify import classify_fault, is_node_fault
from slurm_resilience.supervisor.observe.detect import LivenessServer
from slurm_resilience.supervisor.observe.partition import PartitionWatch, blame, probe_plan
from slurm_resilience.worker.peer_probe import PeerProbe, probe_digest, reach_one

from test_pulse import _until

TOKEN = "p" * 32


def _answers(nodes, cut=(), links=()):
    """Every node probes every other; probes to or from a node in ``cut`` fail, as do the
    (a, b) pairs in ``links`` (both ways)."""
    bad_pairs = {frozenset(p) for p in links}
    out = {}
    for a in nodes:
        ok, bad = set(), set()
        for b in nodes:
            if b != a:
                (bad if a in cut or b in cut or frozenset((a, b)) in bad_pairs else ok).add(b)
        out[a] = (ok, bad)
    return out


def test_the_one_node_every_failed_probe_leads_to_is_blamed():
    node, why = blame(_answers(["n1", "n2", "n3", "n4"], cut={"n3"}))
    assert node == "n3" and why.startswith("cut from its peers: 6 peer probe(s)") and "n1,n2,n4" in why


def test_a_spare_that_still_reaches_the_cut_node_does_not_hide_it():
    answers = _answers(["n1", "n2", "n3", "s"], links=[("n1", "n3"), ("n2", "n3")])
    assert blame(answers)[0] == "n3"


@pytest.mark.parametrize("answers", [
    _answers(["n1", "n2", "n3"]),  # nothing failed
    _answers(["n1", "n2", "n3"], links=[("n1", "n2")]),  # one link: either end may be cut
    _answers(["n1", "n2", "n3", "n4"], cut={"n1", "n2"}),  # two cut nodes: no single explanation
    _answers(["n1", "n2", "n3", "n4"], links=[("n1", "n2"), ("n3", "n4")]),
    _answers(["n1", "n2"], cut={"n2"}),  # two nodes: nothing else to compare with
])
def test_no_single_explanation_blames_no_one(answers):
    assert blame(answers) is None


def test_the_probe_plan_is_everyone_when_small_and_ring_doublings_when_large():
    eps = {f"n{i}": ("127.0.0.1", 1000 + i) for i in range(4)}
    plan = probe_plan(["n0", "n1", "n2", "n3", "x"], eps)  # x: no endpoint, not probed
    assert plan["n0"] == {"n1": ["127.0.0.1", 1001], "n2": ["127.0.0.1", 1002], "n3": ["127.0.0.1", 1003]}
    assert set(plan) == set(eps)
    big = {f"n{i:03d}": ("127.0.0.1", i) for i in range(300)}
    plan = probe_plan(sorted(big), big, fanout=8)
    assert sorted(plan["n000"]) == ["n001", "n002", "n004", "n008", "n016", "n032", "n064", "n128"]
    probers = [a for a, peers in plan.items() if "n150" in peers]
    assert len(probers) == 8  # a cut node is still probed by several peers
    assert probe_plan(["n0"], eps) == {}


class FakeLink:
    def __init__(self, nodes):
        self.eps = {n: ("127.0.0.1", 1) for n in nodes}
        self.asked, self.answers = [], {}

    def endpoints(self):
        return dict(self.eps)

    def reach(self):
        return dict(self.answers)

    def ask_probes(self, requests):
        self.asked.append(requests)
        return []


def test_the_watch_asks_only_after_the_stall_and_blames_from_the_round_in_flight():
    nodes = ["n1", "n2", "n3"]
    link, now = FakeLink(nodes), [100.0]
    pw = PartitionWatch(link, probe_s=3.0, clock=lambda: now[0])
    assert pw.look(lambda: nodes, stalled_s=2.9, longest_step_s=0.1) is None and not link.asked
    assert pw.look(lambda: nodes, stalled_s=3.0, longest_step_s=1.6) is None and not link.asked  # 2 x the step
    assert pw.look(lambda: nodes, stalled_s=3.0, longest_step_s=0.1) is None
    (req,) = link.asked
    rid = req["n1"]["id"]
    assert set(req) == set(nodes) and set(req["n1"]["peers"]) == {"n2", "n3"}
    now[0] += 0.6
    link.answers = {n: {rid: {"ok": ok, "bad": bad}} for n, (ok, bad) in _answers(nodes, cut={"n2"}).items()}
    link.answers["n1"] = {rid - 1: {"ok": set(), "bad": set()}}  # an older round's answer: not this one
    assert pw.look(lambda: nodes, stalled_s=3.6, longest_step_s=0.1) is None  # n1 not in yet, and within the wait
    now[0] += 1.0
    node, why = pw.look(lambda: nodes, stalled_s=4.6, longest_step_s=0.1)
    assert node == "n2" and why.endswith("no answer from n1")
    assert pw.look(lambda: nodes, stalled_s=4.7, longest_step_s=0.1) is None and len(link.asked) == 1  # read once
    now[0] += 3.0
    pw.look(lambda: nodes, stalled_s=7.7, longest_step_s=0.1)
    assert len(link.asked) == 2  # the stall lasts: the next round
    assert pw.look(lambda: nodes, stalled_s=0.0, longest_step_s=0.1) is None  # moving again


def test_a_partitioned_node_is_a_node_fault_and_the_setting_is_checked():
    f = classify_fault(rank=1, node="n2", process_exited=False, slurmd_reachable=True, heartbeat_stale=True,
                       slurm_node_state="ALLOCATED", now=0.0, peers_cut="cut from its peers: 4 ...")
    assert f.kind is FaultKind.NODE_PARTITIONED and is_node_fault(f.kind) and f.detail.startswith("cut from")
    assert load_config({}).detect.peer_probe_s == 2.0
    with pytest.raises(ConfigError, match="peer_probe_s=-1"):
        load_config({"detect": {"peer_probe_s": -1}})


def test_a_probe_needs_the_jobs_secret_and_a_dead_endpoint_answers_no_within_the_deadline():
    probe = PeerProbe(TOKEN)
    probe.listen("127.0.0.31")
    addr, port = probe.endpoint
    served = []

    def serve_until(pred):
        import select
        import threading
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("v", pred()))
        th.start()
        while th.is_alive():
            ready = set(select.select(probe.fds(), [], [], 0.02)[0])
            probe.serve(ready, time.monotonic())
            served.append(len(ready))
        return done["v"]

    assert serve_until(lambda: reach_one(addr, port, "127.0.0.32", probe_digest(TOKEN))) is True
    assert serve_until(lambda: reach_one(addr, port, "127.0.0.32", probe_digest("other"))) is False
    mute = socket.create_server(("127.0.0.34", 0))  # accepts (the kernel does), never answers
    assert reach_one("127.0.0.34", mute.getsockname()[1], None, probe_digest(TOKEN), timeout=0.2) is True
    mute.close()
    closed = socket.socket()
    closed.bind(("127.0.0.33", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    t0 = time.monotonic()
    assert reach_one("127.0.0.33", dead_port, None, probe_digest(TOKEN)) is False
    assert time.monotonic() - t0 < 5
    probe.listener.close()


RANK = r"""
import sys
from slurm_resilience.worker.progress_page import ProgressBoard, ensure_pulse
port, token, directory, wid, node = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
board = ProgressBoard(port, directory, wid)
ensure_pulse(directory, host="127.0.0.1", period_s=0.05,
             hello={"token": token, "worker_id": "pulse@" + node, "node": node, "pid": 0})
print("up", flush=True)
sys.stdin.readline()
board.leave()
"""


def test_real_pulses_announce_their_endpoints_on_the_node_address_and_probe_on_request(tmp_path):
    srv = LivenessServer("127.0.0.1", TOKEN, queue.Queue()).start()
    ranks = []
    try:
        for i, node in enumerate(["n1", "n2"]):
            d = tmp_path / node
            d.mkdir(mode=0o700)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "SR_NODE_ADDR": f"127.0.0.{41 + i}"}
            p = subprocess.Popen([sys.executable, "-c", RANK, str(srv.port), TOKEN, str(d), f"w{i}", node],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            ranks.append(p)
            assert p.stdout.readline().strip() == "up"
        eps = _until(lambda: e if len(e := srv.endpoints()) == 2 else None)
        assert eps["n1"][0] == "127.0.0.41" and eps["n2"][0] == "127.0.0.42"
        gone = socket.socket()
        gone.bind(("127.0.0.43", 0))
        eps["n3"] = ("127.0.0.43", gone.getsockname()[1])  # a node whose pulse does not answer
        gone.close()
        plan = probe_plan(["n1", "n2", "n3"], eps)
        assert srv.ask_probes({n: {"id": 7, "peers": plan[n]} for n in ("n1", "n2")}) == []
        got = _until(lambda: r if len(r := srv.reach()) == 2 else None)
        assert got["n1"] == {7: {"ok": {"n2"}, "bad": {"n3"}}}
        assert got["n2"] == {7: {"ok": {"n1"}, "bad": {"n3"}}}
        assert srv.ask_probes({"n9": {"id": 8, "peers": {}}}) == ["n9"]  # no pulse there
    finally:
        for p in ranks:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=10)
        srv.close()


def test_the_watchdog_keeps_how_long_the_whole_job_has_stalled():
    from slurm_resilience.supervisor.observe.detect import Pulse
    from slurm_resilience.supervisor.observe.watchdog import ProgressWatch

    pw = ProgressWatch(stale_s=2, soft_s=10, hard_s=20, factor=10)

    def look(now, **progress):
        pulses = {w: Pulse(now, v, True, 1, "S", 0) for w, v in progress.items()}
        pw.observe({w: now for w in progress}, pulses, now)

    look(100.0, a=1, b=1)
    assert pw.stalled_s(100.0) == 0.0
    look(101.0, a=1, b=2)  # b moved at 101
    look(104.0, a=1, b=2)
    assert pw.stalled_s(104.0) == 3.0  # since the newest move of any rank
    pw.observe({"a": 105.0, "c": 105.0}, {"a": Pulse(105.0, 1, True, 1, "S", 0)}, 105.0)
    assert pw.stalled_s(105.0) == 0.0  # c never seen: unknown, not stalled


def test_a_silent_node_its_peers_still_reach_is_cut_from_the_supervisor_only():
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    link, now = FakeLink(nodes), [10.0]
    pw = PartitionWatch(link, probe_s=2.0, clock=lambda: now[0])
    assert pw.about("n4", nodes) is None  # asked; waiting
    (req,) = link.asked
    assert set(req) == {"n5", "n1", "n2"} and all(set(r["peers"]) == {"n4"} for r in req.values())  # the ring after n4
    rid = req["n5"]["id"]
    link.answers = {"n5": {rid: {"ok": {"n4"}, "bad": set()}}, "n1": {rid: {"ok": {"n4"}, "bad": set()}}}
    assert pw.about("n4", nodes) is None  # n2 not in yet
    now[0] += 2.0
    why = pw.about("n4", nodes)
    assert why.startswith("cut from the supervisor only") and why.endswith("(n1,n5)")
    assert pw.about("n4", nodes) == why and len(link.asked) == 1  # the answer is kept a while
    now[0] += 2.0
    assert pw.about("n4", nodes) is None and len(link.asked) == 2  # then asked afresh
    rid = link.asked[1]["n5"]["id"]
    link.answers = {n: {rid: {"ok": set(), "bad": {"n4"}}} for n in ("n5", "n1", "n2")}
    assert pw.about("n4", nodes) == ""  # nobody reaches it: not cut from us only (frozen, powered off)
    now[0] += 2.0
    link.eps.pop("n4")
    assert pw.about("n4", nodes) == ""  # its pulse never announced an endpoint: nothing to ask
