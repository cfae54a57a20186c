import dataclasses

import pytest

from slurm_resilience.config import (
    DetectConfig,
    JobConfig,
    ResilienceConfig,
    config_to_dict,
    load_config,
)
from slurm_resilience.errors import ConfigError


def _err(source=None, overrides=None) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(source, overrides)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_defaults():
    cfg = load_config()
    assert cfg == ResilienceConfig()
    assert cfg.job.nodes == 4 and cfg.detect.heartbeat_period_s == 0.25 and cfg.reconnect.backend == "auto"


def test_frozen_kw_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        JobConfig().nodes = 3
    with pytest.raises(TypeError):
        JobConfig(3)


def test_yaml_file(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("job:\n  nodes: 2\n  spares: 0\n  partition: gpu\ndetect:\n  heartbeat_timeout_s: 3\ncheckpoint:\n")
    cfg = load_config(p)
    assert cfg.job.nodes == 2 and cfg.job.spares == 0 and cfg.job.partition == "gpu"
    assert cfg.detect.heartbeat_timeout_s == 3.0 and isinstance(cfg.detect.heartbeat_timeout_s, float)
    assert load_config(str(p)) == cfg


def test_empty_yaml(tmp_path):
    p = tmp_path / "e.yaml"
    p.write_text("")
    assert load_config(p) == ResilienceConfig()


def test_overrides():
    cfg = load_config({"job": {"nodes": 2}}, overrides={"job": {"spares": 3}, "recovery": {"isolate_state": "DRAIN"}})
    assert cfg.job.nodes == 2 and cfg.job.spares == 3 and cfg.recovery.isolate_state == "DRAIN"


def test_roundtrip():
    cfg = load_config({"job": {"nodes": 7, "partition": "p"}, "reconnect": {"gloo_ifname": "lo"}})
    assert load_config(config_to_dict(cfg)) == cfg
    assert load_config(config_to_dict(ResilienceConfig())) == ResilienceConfig()


def test_unknown_key(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text("detect:\n  heartbeat: 1\n")
    assert _err(p) == (
        "unknown key 'detect.heartbeat' in cfg.yaml; valid keys: heartbeat_period_s, heartbeat_timeout_s,"
        " standby_heartbeat_timeout_s, node_poll_s, probe_timeout_s, slurmd_probe_deadline_s, node_silence_s,"
        " straggler_threshold, straggler_window, headless_timeout_s, pulse, progress_soft_s, progress_hard_s, progress_block_s,"
        " progress_factor, peer_probe_s"
    )


def test_unknown_section():
    assert "unknown section 'jobs'" in _err({"jobs": {}})
    assert "unknown section 'x' in overrides" in _err(None, {"x": {}})


@pytest.mark.parametrize(
    "doc,want",
    [
        ({"detect": {"heartbeat_timeout_s": "abc"}}, "detect.heartbeat_timeout_s must be a number, got 'abc'"),
        ({"job": {"nodes": True}}, "job.nodes must be an integer, got True"),
        ({"job": {"nodes": 2.0}}, "job.nodes must be an integer, got 2.0"),
        ({"job": {"supervisor_node": "yes"}}, "job.supervisor_node must be true or false, got 'yes'"),
        ({"job": {"job_dir": 3}}, "job.job_dir must be a string, got 3"),
        ({"job": {"nodes": None}}, "job.nodes must be an integer, got null"),
        ({"detect": {"node_poll_s": False}}, "detect.node_poll_s must be a number, got False"),
        ({"detect": [1]}, "section 'detect' in config must be a mapping"),
    ],
)
def test_wrong_type(doc, want):
    assert want in _err(doc)


@pytest.mark.parametrize(
    "doc,want",
    [
        ({"job": {"nodes": 0}}, "job.nodes=0 must be >= 1"),
        ({"job": {"spares": -1}}, "job.spares=-1 must be >= 0"),
        ({"job": {"tasks_per_node": 0}}, "job.tasks_per_node=0 must be >= 1: one rank per GPU of a node"),
        ({"detect": {"standby_heartbeat_timeout_s": 1}},
         "detect.standby_heartbeat_timeout_s=1.0 must be >= heartbeat_timeout_s=2.0"),
        ({"recovery": {"health_check": "true"}},
         "recovery.health_check must be a list of strings, got 'true'"),
        ({"recovery": {"spare_check_max_age_s": 0}}, "recovery.spare_check_max_age_s=0.0 must be > 0"),
        ({"checkpoint": {"local_min_free_gb": -1}}, "checkpoint.local_min_free_gb=-1.0 must be >= 0 (0 turns it off)"),
        ({"job": {"time_limit": "1h"}}, "job.time_limit='1h' is not a Slurm time"),
        ({"job": {"job_dir": ""}}, "job.job_dir is empty"),
        ({"detect": {"heartbeat_period_s": 0}}, "detect.heartbeat_period_s=0.0 must be > 0 and <= 0.5"),
        ({"detect": {"heartbeat_period_s": 0.6}}, "must be > 0 and <= 0.5"),
        ({"detect": {"heartbeat_timeout_s": 0.5}}, "detect.heartbeat_timeout_s=0.5 must be > 2 * heartbeat_period_s (0.5)"),
        ({"detect": {"node_poll_s": 0}}, "detect.node_poll_s=0.0 must be > 0"),
        ({"detect": {"probe_timeout_s": -1}}, "detect.probe_timeout_s=-1.0 must be > 0"),
        ({"detect": {"slurmd_probe_deadline_s": 0}}, "detect.slurmd_probe_deadline_s=0.0 must be > 0"),
        ({"detect": {"slurmd_probe_deadline_s": 2}},
         "detect.slurmd_probe_deadline_s=2.0 must be < heartbeat_timeout_s=2.0: the probe only decides what a "
         "stale heartbeat means, it must not take longer than noticing it"),
        ({"recovery": {"online_timeout_s": 0}}, "recovery.online_timeout_s=0.0 must be > 0"),
        ({"recovery": {"fault_retry_times": -1}}, "recovery.fault_retry_times=-1 must be >= 0"),
        ({"recovery": {"isolate_state": "IDLE"}}, "recovery.isolate_state='IDLE' must be one of auto, none, DRAIN, DOWN"),
        ({"recovery": {"isolate_hook": "ticket.sh"}}, "recovery.isolate_hook must be a list of strings, got 'ticket.sh'"),
        ({"recovery": {"isolate_hook": [""]}}, "recovery.isolate_hook starts with an empty string"),
        ({"recovery": {"isolate_hook_timeout_s": 0}}, "recovery.isolate_hook_timeout_s=0.0 must be > 0"),
        ({"reconnect": {"backend": "mpi"}}, "reconnect.backend='mpi' must be one of auto, gloo, nccl"),
        ({"reconnect": {"pg_timeout_s": 0}}, "reconnect.pg_timeout_s=0.0 must be > 0"),
        ({"reconnect": {"poll_interval_ms": 0}}, "reconnect.poll_interval_ms=0.0 must be > 0"),
        ({"checkpoint": {"local_every": -1}}, "checkpoint.local_every=-1 must be >= 0"),
        ({"checkpoint": {"local_keep": 0}}, "checkpoint.local_keep=0 must be >= 1"),
        ({"checkpoint": {"local_redundancy": "raid6"}}, "checkpoint.local_redundancy='raid6' must be"),
        ({"checkpoint": {"local_xor_group_size": 1}}, "checkpoint.local_xor_group_size=1 must be >= 2"),
    ],
)
def test_bad_values(doc, want):
    assert want in _err(doc)


@pytest.mark.parametrize("limit", ["00:30:00", "1-00:00:00", "90", "5:00:00"])
def test_time_limits_ok(limit):
    assert JobConfig(time_limit=limit).time_limit == limit


def test_detect_ok_edge():
    assert DetectConfig(heartbeat_period_s=0.5, heartbeat_timeout_s=1.01).heartbeat_period_s == 0.5


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    assert _err(p) == f"config file not found: {p}"


def test_bad_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("job:\n  nodes: [1,\n  x: {\n")
    assert _err(p).startswith(f"invalid YAML in {p}")
    p.write_text("- 1\n- 2\n")
    assert "must hold a mapping of sections" in _err(p)


def test_xor_redundancy_reaches_the_tier_spec():
    from slurm_resilience.checkpoint.tiers import Redundancy

    cfg = load_config({"checkpoint": {"local_redundancy": "xor", "local_xor_group_size": 3}})
    l1 = next(s for s in cfg.checkpoint.tiers() if s.name == "L1")
    assert l1.redundancy is Redundancy.XOR and l1.group_size == 3
