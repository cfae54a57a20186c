"""The timeout hierarchy (config/timeouts.py): each rule refuses its broken order with one
line naming both values; NCCL's watchdog variables; Slurm's timeouts."""

import pytest

from slurm_resilience.config import ReconnectConfig, load_config
from slurm_resilience.config.timeouts import nccl_environ, rules, slurm_warnings, timing_warnings
from slurm_resilience.errors import ConfigError


def _err(doc):
    with pytest.raises(ConfigError) as e:
        load_config(doc)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_the_defaults_are_in_order():
    cfg = load_config({})
    for small, a, large, b, _ in rules(cfg):
        assert a < b, (small, large)


@pytest.mark.parametrize("doc, message", [
    ({"reconnect": {"poll_interval_ms": 300}},
     "reconnect.poll_interval_ms/1000=0.3 must be < detect.heartbeat_period_s=0.25"),
    ({"detect": {"heartbeat_timeout_s": 12, "standby_heartbeat_timeout_s": 20}},
     "detect.heartbeat_timeout_s=12 must be < detect.progress_soft_s=10"),
    ({"reconnect": {"pg_timeout_s": 15}},
     "detect.progress_hard_s=20 must be < reconnect.pg_timeout_s=15"),
    ({"reconnect": {"pg_timeout_s": 200}},
     "reconnect.pg_timeout_s=200 must be < reconnect.nccl_heartbeat_timeout_s=120"),
    ({"detect": {"progress_soft_s": 15, "progress_hard_s": 12}},
     "detect.progress_soft_s=15 must be <= detect.progress_hard_s=12"),
    ({"detect": {"progress_block_s": 2}},
     "detect.heartbeat_timeout_s=2 must be < detect.progress_block_s=2: a healthy rank may go quiet"),
    ({"detect": {"progress_block_s": 25}},
     "detect.progress_block_s=25 must be <= detect.progress_hard_s=20"),
    ({"recovery": {"online_timeout_s": 200}},
     "recovery.online_timeout_s=200 must be <= recovery.fallback_timeout_s=120"),
])
def test_each_rule_names_the_two_conflicting_values(doc, message):
    assert _err(doc).startswith(message)


def test_a_consistent_custom_set_loads():
    cfg = load_config({"detect": {"heartbeat_timeout_s": 8, "progress_soft_s": 9, "progress_hard_s": 9},
                       "reconnect": {"pg_timeout_s": 10, "nccl_heartbeat_timeout_s": 11}})
    assert cfg.detect.progress_hard_s == 9


def test_the_blocking_timeout_floor_follows_the_heartbeat_timeout_unless_set():
    assert load_config({}).detect.block_floor_s == 5.0  # 2.5 x the 2 s heartbeat timeout
    # a raised heartbeat timeout (a loaded box) raises it, never past the hard timeout
    assert load_config({"detect": {"heartbeat_timeout_s": 4}}).detect.block_floor_s == 10.0
    assert load_config({"detect": {"heartbeat_timeout_s": 8, "standby_heartbeat_timeout_s": 16}}
                       ).detect.block_floor_s == 20.0
    assert load_config({"detect": {"progress_block_s": 7}}).detect.block_floor_s == 7.0
    assert load_config({"detect": {"progress_block_s": 20}}).detect.block_floor_s == 20.0  # shortcut off


def test_progress_factor_below_2_is_refused():
    assert _err({"detect": {"progress_factor": 1.5}}) == "detect.progress_factor=1.5 must be >= 2"


def test_nccl_variables_are_set_unless_the_user_set_them():
    c = ReconnectConfig(pg_timeout_s=30, nccl_heartbeat_timeout_s=90.5)
    assert nccl_environ(c, {}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "91"}
    assert nccl_environ(c, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "91"}
    assert nccl_environ(c, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_a_users_nccl_heartbeat_below_the_group_timeout_is_refused():
    c = ReconnectConfig(pg_timeout_s=30)
    with pytest.raises(ConfigError, match=r"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=20 \(environment\) must be > "
                                          r"reconnect.pg_timeout_s=30"):
        nccl_environ(c, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "20"})
    with pytest.raises(ConfigError, match="not a number"):
        nccl_environ(c, {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "soon"})


def test_slurm_timeouts_are_checked_against_detection_and_the_online_deadline():
    cfg = load_config({})
    assert slurm_warnings(cfg, slurmd_timeout_s=300, kill_wait_s=30 - 1) == []
    assert slurm_warnings(cfg, slurmd_timeout_s=None, kill_wait_s=None) == []
    lines = slurm_warnings(cfg, slurmd_timeout_s=2, kill_wait_s=45)
    assert lines[0].startswith("SlurmdTimeout=2 is not above detect.heartbeat_timeout_s=2")
    assert lines[1].startswith("KillWait=45 is not below recovery.online_timeout_s=45")


def test_an_online_deadline_within_the_group_timeout_is_warned_about():
    """A survivor blocked in its own loop's collective (DDP) is released by the group
    timeout only: the defaults leave the online recovery room after it."""
    assert timing_warnings(load_config({})) == []
    lines = timing_warnings(load_config({"recovery": {"online_timeout_s": 30}}))
    assert len(lines) == 1 and lines[0].startswith(
        "recovery.online_timeout_s=30 is not above reconnect.pg_timeout_s=30")


def test_slurm_config_durations_are_parsed():
    from slurm_resilience.slurm.parse import config_seconds

    assert config_seconds("5 sec") == 5.0 and config_seconds("300 sec") == 300.0
    assert config_seconds(None) is None and config_seconds("(null)") is None and config_seconds("INFINITE") is None
