"""Silent node loss, the pure parts and the glue: classification with the slurmd
probe, which nodes are silent, the probe thread's verdicts, the watch holding a
silent node's suspects until the verdict, and decide() moving the node to a spare."""

import subprocess
import threading
import time

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.errors import SlurmCommandError
from slurm_resilience.model import FaultKind
from slurm_resilience.protocol import EventKind, Role
from slurm_resilience.slurm import commands
from slurm_resilience.slurm.steps import SrunLauncher
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.classify import classify_fault
from slurm_resilience.supervisor.decide.decide import decide
from slurm_resilience.supervisor.observe.probe import ASK_MIN_S, NodeProber, silent_nodes
from slurm_resilience.supervisor.observe.watch import Watch

from test_decide import of, policy, started


def fault(**kw):
    base = dict(rank=1, node="n3", process_exited=False, slurmd_reachable=True, heartbeat_stale=True,
                slurm_node_state=None, now=5.0)
    return classify_fault(**{**base, **kw})


# -- classification -----------------------------------------------------------
def test_all_ranks_stale_and_slurmd_silent_is_node_lost_though_tcp_connects():
    f = fault(slurmd_answers=False)
    assert f.kind is FaultKind.NODE_LOST and "did not answer" in f.detail


def test_slurmd_answering_keeps_it_a_process_hang():
    f = fault(slurmd_answers=True)
    assert f.kind is FaultKind.PROCESS_HUNG and "slurmd answered" in f.detail


def test_not_probed_stays_process_level():  # partial staleness: the probe never runs
    assert fault(slurmd_answers=None).kind is FaultKind.PROCESS_HUNG


def test_probe_counts_only_with_a_stale_heartbeat():
    assert fault(slurmd_answers=False, process_exited=True, heartbeat_stale=False).kind is FaultKind.PROCESS_DIED


def test_a_bad_slurm_state_rule_comes_first_and_is_a_node_fault_either_way():
    assert fault(slurmd_answers=False, slurm_node_state="ALLOCATED*").kind is FaultKind.NODE_UNHEALTHY
    assert fault(slurmd_reachable=False, slurm_node_state="ALLOCATED*").kind is FaultKind.NODE_LOST


# -- which nodes are silent -------------------------------------------------------
@pytest.mark.parametrize("suspects,want", [
    ({"a": {"heartbeat_stale": True}, "b": {"heartbeat_stale": True}}, {"n3"}),
    ({"a": {"heartbeat_stale": True}}, set()),  # b still beats: process-level
    ({"a": {"heartbeat_stale": True}, "b": {"heartbeat_stale": True, "process_exited": True}}, set()),
    ({"a": {"heartbeat_stale": True}, "b": {"heartbeat_stale": True, "node_state": "DOWN*"}}, set()),
    ({}, set()),
])
def test_silent_nodes(suspects, want):
    assert silent_nodes({"n3": ["a", "b"], "n4": []}, suspects) == want


# -- the probe thread ------------------------------------------------------------
def _prober(answer, reachable=True, deadline=0.2):
    return NodeProber(lambda node, t: reachable, answer, deadline)


def _one(prober, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = prober.drain()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("no probe result")


def test_prober_reports_answer_and_timing():
    seen = {}

    def answer(node, names, left):
        seen.update(node=node, names=names, left=left)
        return True, "answered"
    p = _prober(answer)
    assert p.start("n3", ["sr-w1", "sr-w2"])
    (r,) = _one(p)
    assert (r.node, r.reachable, r.answered) == ("n3", True, True) and r.ended >= r.started
    assert seen["names"] == ("sr-w1", "sr-w2") and 0 < seen["left"] <= max(ASK_MIN_S, 0.2)


def test_a_connect_that_came_late_still_leaves_slurmd_time_to_answer():
    """The link flapped back at the end of the probe's deadline: the request still gets ASK_MIN_S."""
    seen = {}

    def late(node, t):
        time.sleep(t)  # the whole deadline spent on the connect
        return True

    def answer(node, names, left):
        seen["left"] = left
        return True, "answered"
    p = NodeProber(late, answer, 0.1)
    p.start("n3", ["sr-w1"])
    (r,) = _one(p)
    assert r.answered is True and seen["left"] == ASK_MIN_S


def test_prober_unreachable_port_is_silent_without_asking():
    p = _prober(lambda *a: pytest.fail("asked a closed port"), reachable=False)
    p.start("n3", [])
    (r,) = _one(p)
    assert (r.reachable, r.answered) == (False, False)


def test_prober_broken_probe_is_no_verdict():
    def boom(*a):
        raise RuntimeError("squeue exploded")
    p = _prober(boom)
    p.start("n3", [])
    (r,) = _one(p)
    assert r.answered is None and "squeue exploded" in r.detail


def test_prober_runs_one_probe_per_node_and_knows_when_it_is_overdue(monkeypatch):
    release = threading.Event()

    def slow(*a):
        release.wait(5)
        return False, "silent"
    p = _prober(slow, deadline=0.01)
    assert p.start("n3", []) and not p.start("n3", [])
    assert not p.overdue("n4")
    monkeypatch.setattr("slurm_resilience.supervisor.observe.probe.HOLD_GRACE_S", 0.0)
    time.sleep(0.05)
    assert p.overdue("n3")
    release.set()
    (r,) = _one(p)
    assert r.answered is False and not p.overdue("n3")


# -- the launcher's probe: sstat of one of our steps there --------------------------
class FakeSlurm:
    def __init__(self, monkeypatch, stat):
        monkeypatch.setattr(commands, "show_nodes", lambda names: {
            n: {"NodeName": n, "NodeAddr": "127.0.0.1", "Port": "17003"} for n in names})
        monkeypatch.setattr(commands, "run", lambda argv, **kw: subprocess.CompletedProcess(
            argv, 0, "41.0 sr-w1\n41.3 sr-w2\n41.batch batch\n", ""))
        self.calls = []

        def step_stat(job, step, timeout):
            self.calls.append((job, step, timeout))
            stat()
        monkeypatch.setattr(commands, "step_stat", step_stat)


def _timeout():
    raise SlurmCommandError(["sstat"], None, "timed out after 0.3s")


def _no_binary():
    raise SlurmCommandError(["sstat"], None, "`sstat` not found: install Slurm")


@pytest.mark.parametrize("stat,names,want", [
    (lambda: None, ["sr-w2"], True),
    (_timeout, ["sr-w2"], False),
    (_no_binary, ["sr-w2"], None),  # not a silent node: sstat is missing here
    (lambda: None, ["sr-w9"], None),  # none of our steps there: nothing to ask
])
def test_probe_slurmd(monkeypatch, stat, names, want):
    fake = FakeSlurm(monkeypatch, stat)
    answered, why = SrunLauncher("41", ["n3"]).probe_slurmd("n3", names, 0.3)
    assert answered is want, why
    if names == ["sr-w2"]:
        assert fake.calls[0][:2] == ("41", "3") and 0 < fake.calls[0][2] <= 0.3


# -- the watch holds a silent node's suspects until the verdict ----------------------
class Launcher:
    def __init__(self, answered, reachable=True):
        self.answered, self.asked, self.reachable, self.connects = answered, [], reachable, []

    def node_reachable(self, node, timeout_s):
        self.connects.append(node)
        return self.reachable

    def probe_slurmd(self, node, names, deadline_s):
        self.asked.append((node, tuple(names)))
        return self.answered, "fake"


class Store:
    def check(self, keys):
        return False


def _watch(launcher):
    return Watch(cfg=load_config({}), store=Store(), seen=None, launcher=launcher, handles={}, events=None,
                 preempted=lambda: False)


def _released(w, state, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = w._probed(state)
        if got:
            return w._probe(state, {}, got)
        time.sleep(0.005)
    raise AssertionError("never released")


@pytest.mark.parametrize("answered,kind", [(False, "node-replacement"), (True, "online")])
def test_watch_holds_a_silent_node_until_the_probe_and_decide_acts_on_it(answered, kind):
    p = policy()
    state, _ = started(p)
    launcher = Launcher(answered)
    w = _watch(launcher)
    frozen = state.table.slots[1]
    suspects = {frozen.worker_id: {"t": 1.0, "heartbeat_stale": True}}
    w._hold_silent(state, suspects)
    assert suspects == {} and frozen.node in w._held  # held, not reported yet
    obs = _released(w, state)
    (s,) = obs.items
    assert s.slurmd_answers is answered and s.slurmd_reachable is True and s.probe_s is not None
    assert launcher.asked == [(frozen.node, (state.workers[frozen.worker_id].step_name,))]
    state2, acts = decide(state, obs, 2.0, p)
    assert state2.recovery.level == kind
    ev = [a for a in of(acts, m.Emit) if a.kind is EventKind.FAULT_DETECTED][0]
    assert ev.fields["slurmd_answers"] is answered and ev.fields["probe_s"] == pytest.approx(s.probe_s, abs=1e-3)
    launches = [(a.node, a.role) for a in of(acts, m.Launch)]
    if answered is False:  # nothing is started on the silent node; it is isolated
        assert launches == [] and of(acts, m.Isolate)[0].node == frozen.node
        assert of(acts, m.Publish)[0].plan.table.slots[1].node == "n5"
    else:
        assert launches == [(frozen.node, Role.RANK)]


def test_watch_reports_partial_staleness_at_once_without_a_node_probe():
    from test_decide import started_g2
    p = policy()
    state, _ = started_g2(p)
    launcher = Launcher(False)
    w = _watch(launcher)
    one = state.table.slots[2]  # n3 has ranks 2 and 3; only rank 2 is stale
    suspects = {one.worker_id: {"t": 1.0, "heartbeat_stale": True}}
    w._hold_silent(state, suspects)
    assert one.worker_id in suspects and not w._held
    time.sleep(0.05)
    assert launcher.asked == []
    (s,) = w._probe(state, suspects).items
    assert s.slurmd_answers is None
    state2, _ = decide(state, m.Suspects((s,)), 2.0, p)
    assert state2.recovery.level == "online"


def test_the_probe_starts_early_and_its_verdict_counts_only_if_it_began_after_the_last_beat():
    p = policy()
    state, _ = started(p)
    launcher = Launcher(False)
    w = _watch(launcher)
    frozen = state.table.slots[1]
    node, wid = frozen.node, frozen.worker_id
    now = 100.0
    beats = {s.worker_id: now for s in state.table.slots}
    beats[wid] = now - 1.5  # quiet for 1.5 s: heartbeat_timeout 2.0 - deadline 0.3 - period 0.25 = 1.45
    w._beats.update(beats)
    w._probe_early(state, beats, now)
    deadline = time.monotonic() + 5
    while not w._verdicts and time.monotonic() < deadline:
        w._verdicts.update({r.node: r for r in w.prober.drain()})
        time.sleep(0.005)
    assert list(w._verdicts) == [node] and launcher.asked == [(node, (state.workers[wid].step_name,))]
    # a verdict older than the node's newest beat is stale: a new probe is asked
    w._beats[wid] = w._verdicts[node].started + 0.001
    time.sleep(0.01)
    w._hold_silent(state, {wid: {"t": now + 0.5, "heartbeat_stale": True}})
    assert w._probed(state) == {} and node in w._held
    obs = _released(w, state)
    assert obs.items[0].slurmd_answers is False and len(launcher.asked) == 2


def test_quiet_ranks_below_the_lead_are_not_probed():
    p = policy()
    state, _ = started(p)
    launcher = Launcher(False)
    w = _watch(launcher)
    beats = {s.worker_id: 100.0 - 1.0 for s in state.table.slots}
    w._probe_early(state, beats, 100.0)
    time.sleep(0.05)
    assert launcher.asked == [] and w.prober.drain() == []


def test_a_frozen_node_whose_ranks_turn_stale_in_different_polls_is_silent():
    """A frozen node's ranks beat last at slightly different times: in one poll only
    some are stale, the rest quiet long enough that the probe has started. Held as a
    silent node (the probe decides), not sent on as process-level hangs."""
    stale = {"a": {"heartbeat_stale": True}}
    assert silent_nodes({"n3": ["a", "b"]}, stale, quiet={"a", "b"}) == {"n3"}
    assert silent_nodes({"n3": ["a", "b"]}, stale, quiet={"a"}) == set()  # b beats: process-level
    assert silent_nodes({"n3": ["a", "b"]}, {}, quiet={"a", "b"}) == set()  # nothing stale yet
    exited = {"a": {"heartbeat_stale": True, "process_exited": True}}
    assert silent_nodes({"n3": ["a", "b"]}, exited, quiet={"a", "b"}) == set()


def test_a_silent_node_whose_slurmd_answers_and_whose_peers_reach_it_is_cut_from_the_supervisor():
    """partition-supervisor: no heartbeat, no pulse line, slurmd answers; its peers still
    reach its pulse: NODE_PARTITIONED at the silence deadline (replaced), not a hang."""
    from slurm_resilience.supervisor.observe.probe import NodeProbed
    from slurm_resilience.supervisor.observe.silence import silence
    from test_partition import FakeLink

    p = policy()
    state, _ = started(p)
    cut = state.table.slots[1]
    nodes = state.watched_nodes()
    link = FakeLink(nodes)
    w = Watch(cfg=load_config({}), store=Store(), seen=None, launcher=Launcher(True), handles={}, events=None,
              preempted=lambda: False, peers=link)
    now = time.time()
    w._hb_heard = {n: now for n in nodes}
    w._hb_heard[cut.node] = now - 1.0  # quiet past node_silence_s (0.9 s)
    w._verdicts[cut.node] = NodeProbed(cut.node, True, True, "answered", now - 0.2, now - 0.1)
    suspects = {}
    silence(w, state, suspects, now)
    assert not w._held and len(link.asked) == 1  # its peers asked; nothing concluded yet
    (ask,) = link.asked
    link.answers = {n: {r["id"]: {"ok": {cut.node}, "bad": set()}} for n, r in ask.items()}
    silence(w, state, suspects, now + 0.05)
    assert cut.node in w._held and w._held[cut.node][cut.worker_id]["peers_cut"].startswith("cut from the supervisor")
    obs = _released(w, state)
    (s,) = obs.items
    assert s.peers_cut and s.slurmd_answers is True
    state2, acts = decide(state, obs, now + 0.1, p)
    assert state2.recovery.level == "node-replacement"
    ev = [a for a in of(acts, m.Emit) if a.kind is EventKind.FAULT_DETECTED][0]
    assert ev.fields["fault"]["kind"] == FaultKind.NODE_PARTITIONED.value


def test_peers_are_asked_once_slurmd_answers_but_a_node_heard_before_the_deadline_is_not_held():
    """A flap: the node quiet 0.7 s, its slurmd answered once the link was back, its peers
    reach it. They are asked at once (their word is in by the deadline) but nothing is
    held before the node has been quiet for node_silence_s; heard again, it never is."""
    from slurm_resilience.supervisor.observe.probe import NodeProbed
    from slurm_resilience.supervisor.observe.silence import silence
    from test_partition import FakeLink

    p = policy()
    state, _ = started(p)
    cut = state.table.slots[1]
    nodes = state.watched_nodes()
    link = FakeLink(nodes)
    cfg = load_config({})
    w = Watch(cfg=cfg, store=Store(), seen=None, launcher=Launcher(True), handles={}, events=None,
              preempted=lambda: False, peers=link)
    now = time.time()
    w._hb_heard = {n: now for n in nodes}
    w._hb_heard[cut.node] = now - 0.7  # past the probe's start, short of node_silence_s
    w._verdicts[cut.node] = NodeProbed(cut.node, True, True, "answered", now - 0.1, now - 0.02)
    suspects = {}
    silence(w, state, suspects, now)
    assert len(link.asked) == 1 and not w._held  # asked before the deadline
    (ask,) = link.asked
    link.answers = {n: {r["id"]: {"ok": {cut.node}, "bad": set()}} for n, r in ask.items()}
    silence(w, state, suspects, now + 0.05)
    assert not w._held  # they reach it, but it has been quiet 0.75 s only
    w._hb_heard[cut.node] = now + 0.1  # its pulse is back on a fresh connection
    silence(w, state, suspects, now + cfg.detect.silence_s)
    assert not w._held and not suspects


def test_a_stopped_rank_whose_pulse_still_speaks_is_hung_not_cut_from_the_supervisor():
    """G = 1: one SIGSTOPped rank makes its node's every rank stale, but the node's pulse
    still sends its lines: its processes are hung (restart in place), its peers not asked."""
    from test_partition import FakeLink

    p = policy()
    state, _ = started(p)
    stopped = state.table.slots[1]
    link = FakeLink(state.watched_nodes())
    w = Watch(cfg=load_config({}), store=Store(), seen=None, launcher=Launcher(True), handles={}, events=None,
              preempted=lambda: False, peers=link, heard=lambda: {stopped.node: time.time()})
    w._hold_silent(state, {stopped.worker_id: {"t": 1.0, "heartbeat_stale": True}})
    obs = _released(w, state)
    (s,) = obs.items
    assert not s.peers_cut and s.slurmd_answers is True and link.asked == []
    state2, _ = decide(state, obs, 2.0, p)
    assert state2.recovery.level == "online"


@pytest.mark.parametrize("reachable", [False, True])
def test_a_node_pulse_s_close_asks_its_slurmd_at_once_and_a_refusal_loses_the_node(reachable):
    """The pulse's connection closed (a node's processes killed: the small pulse is torn
    down first). slurmd refuses too: every worker of the node is a suspect now, before
    their own connections close, and decide replaces the node. slurmd answers: the pulse
    ended alone (its ranks start a new one), nothing is suspected."""
    import queue

    from slurm_resilience.supervisor.observe.detect import Sighting, SightingKind

    p = policy()
    state, _ = started(p)
    gone = state.table.slots[1]
    seen = queue.Queue()
    launcher = Launcher(True, reachable=reachable)
    w = Watch(cfg=load_config({}), store=Store(), seen=seen, launcher=launcher, handles={}, events=None,
              preempted=lambda: False)
    seen.put(Sighting(SightingKind.PULSE_CLOSED, None, gone.node, 1.0))
    suspects = {}
    assert w._drain(state, suspects, 0.0) == []
    assert launcher.connects == [gone.node]
    on_node = {wid for wid, x in state.workers.items() if x.node == gone.node and state.watched(wid)}
    if reachable:
        assert suspects == {}
        return
    assert set(suspects) == on_node and gone.worker_id in on_node
    obs = w._probe(state, suspects)
    assert {s.slurmd_reachable for s in obs.items} == {False} and not any(s.process_exited for s in obs.items)
    state2, acts = decide(state, obs, 2.0, p)
    assert state2.recovery.level == "node-replacement"
    ev = [a for a in of(acts, m.Emit) if a.kind is EventKind.FAULT_DETECTED][0]
    assert ev.fields["fault"]["kind"] == FaultKind.NODE_LOST.value
    # the node's rank and its own standby came in together: the node is isolated once
    assert [a.node for a in of(acts, m.Isolate)] == [gone.node]
