"""A node pulse's close, and its slurmd asked at once and again (``probe.PulseCloses``).

A node whose processes are all killed at once closes their sockets in no set order: the
pulse's can close while slurmd's listening socket still takes a connection. The first
ask then finds slurmd, and the node is judged only when it is asked again.
"""

from __future__ import annotations

import types

from slurm_resilience.supervisor.observe.probe import PULSE_RECHECK_S, PulseCloses


def _state(workers: dict[str, str], excluded=()):
    """A supervisor state whose workers are all watched."""
    return types.SimpleNamespace(excluded=set(excluded),
                                 watched_on=lambda node: [w for w, n in workers.items() if n == node])


class _Slurmd:
    """slurmd's port per node: answers while ``up`` holds it; counts the asks."""

    def __init__(self, up: set[str]) -> None:
        self.up, self.asked = set(up), []

    def __call__(self, node: str) -> bool:
        self.asked.append(node)
        return node in self.up


def test_a_pulse_close_whose_slurmd_refuses_makes_the_node_s_workers_suspects_at_once():
    slurmd = _Slurmd(up=set())
    closes, suspects = PulseCloses(slurmd), {}
    closes.closed("n1", 100.0, ["w1", "w2"], suspects)
    assert suspects == {"w1": {"t": 100.0}, "w2": {"t": 100.0}}
    closes.look(101.0, _state({"w1": "n1", "w2": "n1"}), suspects)
    assert slurmd.asked == ["n1"]  # judged: not asked again


def test_a_slurmd_that_outlives_the_pulse_by_a_moment_is_asked_again_and_the_node_judged():
    slurmd = _Slurmd(up={"n1"})
    closes, suspects = PulseCloses(slurmd), {}
    state = _state({"w1": "n1", "w2": "n1", "w3": "n2"})
    closes.closed("n1", 100.0, ["w1", "w2"], suspects)
    assert suspects == {}  # slurmd took the connection: no verdict yet
    closes.look(100.0 + PULSE_RECHECK_S[0] / 2, state, suspects)
    assert slurmd.asked == ["n1"]  # not due yet
    slurmd.up.clear()  # its listening socket closed meanwhile
    closes.look(100.0 + PULSE_RECHECK_S[0], state, suspects)
    # the suspects carry the pulse's close as their time, not the re-ask's
    assert suspects == {"w1": {"t": 100.0}, "w2": {"t": 100.0}}
    closes.look(200.0, state, {})
    assert slurmd.asked == ["n1", "n1"]


def test_a_pulse_that_ended_on_a_live_node_is_asked_about_a_few_times_then_let_go():
    slurmd = _Slurmd(up={"n1"})
    closes, suspects = PulseCloses(slurmd), {}
    state = _state({"w1": "n1"})
    closes.closed("n1", 100.0, ["w1"], suspects)
    for delay in PULSE_RECHECK_S:
        closes.look(100.0 + delay, state, suspects)
    closes.look(200.0, state, suspects)
    assert suspects == {} and slurmd.asked == ["n1"] * (1 + len(PULSE_RECHECK_S))


def test_a_node_excluded_before_the_re_ask_is_not_asked_about_again():
    slurmd = _Slurmd(up={"n1"})
    closes, suspects = PulseCloses(slurmd), {}
    closes.closed("n1", 100.0, ["w1"], suspects)
    slurmd.up.clear()
    closes.look(100.0 + PULSE_RECHECK_S[-1], _state({"w1": "n1"}, excluded={"n1"}), suspects)
    assert suspects == {} and slurmd.asked == ["n1"]
    closes.look(200.0, _state({"w1": "n1"}), suspects)
    assert slurmd.asked == ["n1"]  # let go


def test_a_pulse_close_on_a_node_with_no_watched_worker_asks_nothing():
    slurmd = _Slurmd(up=set())
    closes, suspects = PulseCloses(slurmd), {}
    closes.closed("n1", 100.0, [], suspects)
    closes.look(200.0, _state({}), suspects)
    assert suspects == {} and slurmd.asked == []
