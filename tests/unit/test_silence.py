"""Node silence (supervisor/observe/silence.py): probe a quiet node early, find it lost
once it stays quiet and its slurmd does not answer. Pure decisions."""

from slurm_resilience.config import DetectConfig
from slurm_resilience.errors import ConfigError
from slurm_resilience.supervisor.observe.probe import NodeProbed
from slurm_resilience.supervisor.observe.silence import quiet_nodes

import pytest

KW = dict(silence_s=0.7, probe_s=0.3, period_s=0.25)


def _v(node, started, answered):
    return NodeProbed(node, True, answered, "", started, started + 0.3)


def test_a_node_quiet_past_silence_minus_probe_time_is_probed_once():
    last = {"n1": 100.0, "n2": 100.5}
    assert quiet_nodes(last, 100.55, verdicts={}, **KW) == (["n1"], [])  # n1 quiet 0.55 >= 0.4
    assert quiet_nodes(last, 100.35, verdicts={}, **KW) == ([], [])  # quiet 0.35: not yet
    # a probe started after its last sign: not again (one probe per silence)
    assert quiet_nodes(last, 100.6, verdicts={"n1": _v("n1", 100.45, None)}, **KW) == ([], [])


def test_silent_only_when_quiet_past_the_deadline_and_slurmd_did_not_answer_since_its_last_sign():
    last = {"n1": 100.0, "n2": 100.6}
    no = {"n1": _v("n1", 100.45, False)}
    assert quiet_nodes(last, 100.75, verdicts=no, **KW) == ([], ["n1"])
    assert quiet_nodes(last, 100.65, verdicts=no, **KW) == ([], [])  # not quiet long enough yet
    yes = {"n1": _v("n1", 100.45, True)}  # slurmd answered: a slow node, not a lost one
    assert quiet_nodes(last, 100.75, verdicts=yes, **KW) == ([], [])
    assert quiet_nodes({"n1": 100.0, "n2": 101.1}, 101.2, verdicts=yes, **KW) == (["n1"], [])  # quiet: asked again
    old = {"n1": _v("n1", 99.9, False)}  # asked before its last sign of life: asked again
    assert quiet_nodes(last, 100.75, verdicts=old, **KW) == (["n1"], [])


def test_nothing_is_concluded_when_no_node_is_heard_the_observer_is_behind():
    last = {"n1": 100.0, "n2": 100.0}
    no = {n: _v(n, 100.45, False) for n in last}
    assert quiet_nodes(last, 101.0, verdicts=no, **KW) == ([], [])
    assert quiet_nodes({"n1": 100.0}, 101.0, verdicts={"n1": no["n1"]}, **KW) == ([], ["n1"])  # one node: no peer


def test_nodes_never_heard_or_already_held_are_left_to_the_heartbeat_path():
    last = {"n1": 0.0, "n2": 100.0, "n3": 100.9}
    assert quiet_nodes(last, 101.0, verdicts={}, held=["n2"], **KW) == ([], [])


def test_the_deadline_defaults_to_0_9_s_capped_by_the_heartbeat_timeout_and_is_checked():
    assert DetectConfig().silence_s == 0.9
    assert DetectConfig(heartbeat_period_s=0.1, heartbeat_timeout_s=0.5).silence_s == 0.5
    assert DetectConfig(heartbeat_period_s=0.1, heartbeat_timeout_s=0.3, slurmd_probe_deadline_s=0.25).silence_s == 0.3
    assert DetectConfig(node_silence_s=0).silence_s == 0
    with pytest.raises(ConfigError, match="node_silence_s=3.0 must be"):
        DetectConfig(node_silence_s=3.0)
    with pytest.raises(ConfigError, match="node_silence_s=0.2 must be > slurmd_probe_deadline_s"):
        DetectConfig(node_silence_s=0.2)
