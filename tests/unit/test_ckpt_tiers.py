import math

import pytest

from slurm_resilience.checkpoint.intervals import IntervalEstimator, auto_steps, daly_interval, young_daly_interval
from slurm_resilience.checkpoint.layout import expand_path
from slurm_resilience.checkpoint.tiers import (
    Redundancy,
    TierSpec,
    base_tier,
    check_tiers,
    default_tiers,
    parse_tiers,
    tier_for_step,
)
from slurm_resilience.errors import CheckpointError, ConfigError

L0 = TierSpec(name="L0", storage="memory", interval_steps=2)
L1 = TierSpec(name="L1", storage="local", interval_steps=10, redundancy=Redundancy.XOR, path="/tmp/{job_id}")
L2 = TierSpec(name="L2", storage="shared", every_kth=3, path="{job_dir}/ck")


# -- TierSpec validation --------------------------------------------------------


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(storage="memory"), "exactly one of interval_steps, interval_s, auto, every_kth (got none)"),
        (dict(storage="memory", interval_steps=1, auto=True), "(got interval_steps, auto)"),
        (dict(storage="memory", interval_steps=1, interval_s=2.0), "(got interval_steps, interval_s)"),
        (dict(storage="shared", path="p", every_kth=2, interval_s=2.0), "(got interval_s, every_kth)"),
        (dict(storage="disk", interval_steps=1), "storage='disk' must be one of memory, local, shared"),
        (dict(storage="memory", interval_steps=0), "interval_steps=0 must be >= 1"),
        (dict(storage="memory", interval_s=0.0), "interval_s=0.0 must be > 0"),
        (dict(storage="local", path="p", every_kth=2), "every_kth is for shared tiers only"),
        (dict(storage="shared", path="p", every_kth=0), "every_kth=0 must be >= 1"),
        (dict(storage="memory", interval_steps=1, redundancy=Redundancy.PARTNER), "redundancy=partner needs storage 'local'"),
        (dict(storage="shared", path="p", interval_steps=1, redundancy=Redundancy.XOR), "redundancy=xor needs storage 'local'"),
        (dict(storage="local", path="p", interval_steps=1, redundancy="xor"), "must be a Redundancy"),
        (dict(storage="local", path="p", interval_steps=1, group_size=1), "group_size=1 must be >= 2"),
        (dict(storage="memory", interval_steps=1, keep=0), "keep=0 must be >= 1"),
        (dict(storage="local", path="p", interval_steps=1, keep_every=5), "keep_every is for shared tiers only"),
        (dict(storage="shared", path="p", interval_steps=1, keep_every=0), "keep_every=0 must be >= 1"),
        (dict(storage="memory", interval_steps=1, path="/x"), "a memory tier has no path"),
        (dict(storage="local", interval_steps=1), "storage 'local' needs a path"),
        (dict(storage="shared", interval_steps=1, path=""), "storage 'shared' needs a path"),
        (dict(storage="local", interval_steps=1, path="/x/{host}"), "placeholder {host} is unknown"),
        (dict(storage="local", interval_steps=1, path="/x/{"), "is not a valid template"),
    ],
)
def test_tierspec_rejects(kw, msg):
    with pytest.raises(ConfigError) as e:
        TierSpec(name="T", **kw)
    assert msg in str(e.value)
    assert "\n" not in str(e.value)


def test_tierspec_empty_name():
    with pytest.raises(ConfigError, match="non-empty"):
        TierSpec(name="", storage="memory", interval_steps=1)


def test_tierspec_frozen_kw_only():
    with pytest.raises(TypeError):
        TierSpec("L0", "memory")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        L0.keep = 3  # type: ignore[misc]


def test_tierspec_valid_forms():
    a = TierSpec(name="a", storage="memory", auto=True)
    assert (a.storage, a.auto, a.path, a.interval_steps, a.interval_s) == ("memory", True, None, None, None)
    assert a.redundancy is Redundancy.NONE and a.keep == 2  # the defaults
    b = TierSpec(name="b", storage="shared", path="{job_dir}/{job_id}/{node}/{rank}", interval_s=60.0, keep_every=100)
    assert (b.path, b.interval_s, b.keep_every, b.auto) == ("{job_dir}/{job_id}/{node}/{rank}", 60.0, 100, False)
    assert expand_path(b, job_dir="/j", job_id=7, node="n2", rank=3) == "/j/7/n2/3"
    c = TierSpec(name="c", storage="local", path="/l", interval_steps=5, redundancy=Redundancy.PARTNER)
    assert (c.interval_steps, c.redundancy, c.group_size) == (5, Redundancy.PARTNER, 4)
    check_tiers((a, b, c))  # a consistent set: raises nothing


def test_expand_path():
    assert expand_path(L1, job_id="42") == "/tmp/42"
    run = "ab" * 16
    assert (expand_path(default_tiers()[1], job_id=7, run_id=run, node="n1", user="ann")
            == f"/tmp/slurm_resilience-ann/7/{run}/n1/ckpt")  # a run of its own: a reused job id cannot collide
    with pytest.raises(ConfigError, match=r"needs a value for \{job_dir\}"):
        expand_path(L2, job_id=1)
    with pytest.raises(ConfigError, match="no path"):
        expand_path(L0)


# -- tier_for_step ---------------------------------------------------------------


def _run(specs, steps, **kw):
    """Drive tier_for_step like the engine would: track last saves and counts."""
    last: dict = {}
    counts: dict = {}
    out = {}
    for step in steps:
        names = tier_for_step(specs, step, now=float(step), last_saved=last, save_counts=counts, **kw)
        for n in names:
            last[n] = (step, float(step))
            counts[n] = counts.get(n, 0) + 1
        out[step] = names
    return out


def test_step_intervals_and_every_kth():
    out = _run([L0, L1, L2], range(1, 61))
    assert [s for s, n in out.items() if "L0" in n] == list(range(2, 61, 2))
    assert [s for s, n in out.items() if "L1" in n] == [10, 20, 30, 40, 50, 60]
    assert [s for s, n in out.items() if "L2" in n] == [30, 60]  # 3rd and 6th L1 checkpoint
    assert out[30] == ["L0", "L1", "L2"]
    assert out[3] == []


def test_every_kth_counts_resume():
    # 2 L1 checkpoints happened before a restart: the next one is the 3rd -> drain
    names = tier_for_step([L1, L2], 70, now=0.0, last_saved={}, save_counts={"L1": 2})
    assert names == ["L1", "L2"]
    assert tier_for_step([L1, L2], 70, now=0.0, last_saved={}, save_counts={"L1": 3}) == ["L1"]
    assert tier_for_step([L1, L2], 71, now=0.0, last_saved={}, save_counts={"L1": 2}) == []
    # every_kth=1 drains every base checkpoint
    l2 = TierSpec(name="L2", storage="shared", every_kth=1, path="p")
    assert tier_for_step([L1, l2], 10, now=0.0, last_saved={}) == ["L1", "L2"]


def test_every_kth_base_is_memory_without_local():
    l2 = TierSpec(name="L2", storage="shared", every_kth=2, path="p")
    out = _run([L0, l2], range(1, 9))
    assert [s for s, n in out.items() if "L2" in n] == [4, 8]
    assert base_tier([l2, L0]) is L0
    assert base_tier([L0, L1, L2]) is L1
    assert base_tier([L2]) is None
    with pytest.raises(CheckpointError, match="no local/memory tier"):
        tier_for_step([l2], 4, now=0.0, last_saved={})


def test_order_follows_specs():
    assert tier_for_step([L2, L1, L0], 30, now=0.0, last_saved={}, save_counts={"L1": 2}) == ["L2", "L1", "L0"]


def test_time_interval():
    t = TierSpec(name="T", storage="memory", interval_s=30.0)
    assert tier_for_step([t], 1, now=5.0, last_saved={}) == ["T"]  # never saved: due
    assert tier_for_step([t], 2, now=29.9, last_saved={"T": (1, 0.0)}) == []
    assert tier_for_step([t], 2, now=30.0, last_saved={"T": (1, 0.0)}) == ["T"]


def test_auto_interval():
    a = TierSpec(name="A", storage="memory", auto=True)
    assert tier_for_step([a], 6, now=0, last_saved={"A": (1, 0.0)}, auto_interval_steps={"A": 5}) == ["A"]
    assert tier_for_step([a], 5, now=0, last_saved={"A": (1, 0.0)}, auto_interval_steps={"A": 5}) == []
    assert tier_for_step([a], 5, now=0, last_saved={}, auto_interval_steps={"A": 5}) == ["A"]
    out = _run([a], range(1, 20), auto_interval_steps={"A": 4})
    assert [s for s, n in out.items() if n] == [4, 8, 12, 16]
    with pytest.raises(CheckpointError, match="auto_interval_steps has no entry"):
        tier_for_step([a], 5, now=0, last_saved={})


def test_tier_for_step_pure():
    last = {"L1": (10, 1.0)}
    counts = {"L1": 1}
    tier_for_step([L0, L1, L2], 20, now=2.0, last_saved=last, save_counts=counts)
    assert last == {"L1": (10, 1.0)} and counts == {"L1": 1}


# -- Young / Daly -----------------------------------------------------------------


def test_young():
    assert young_daly_interval(10.0, 3600.0) == pytest.approx(math.sqrt(2 * 10 * 3600))
    assert young_daly_interval(0.0, 100.0) == 0.0


def test_daly():
    c, m = 10.0, 3600.0
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    assert daly_interval(c, m) == pytest.approx(expected)
    # Daly is close to Young for small C/M, a bit lower overall
    assert abs(daly_interval(c, m) - young_daly_interval(c, m)) < c
    assert daly_interval(200.0, 100.0) == 100.0  # C >= 2M -> M
    assert daly_interval(199.0, 100.0) > 0


@pytest.mark.parametrize("c, m", [(-1.0, 10.0), (1.0, 0.0), (1.0, -5.0), (float("nan"), 1.0)])
def test_bad_cost_mtbf(c, m):
    with pytest.raises(ConfigError):
        young_daly_interval(c, m)
    with pytest.raises(ConfigError):
        daly_interval(c, m)


def test_auto_steps():
    tau = daly_interval(10.0, 3600.0)
    assert auto_steps(10.0, 3600.0, 1.0) == int(tau)
    assert auto_steps(10.0, 3600.0, 2.0) == int(tau // 2)
    assert auto_steps(0.0, 3600.0, 1.0) == 1
    assert auto_steps(10.0, 3600.0, 1e6) == 1
    with pytest.raises(ConfigError, match="step_time_s"):
        auto_steps(1.0, 1.0, 0.0)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_estimator_initial_and_ewma():
    clock = Clock()
    est = IntervalEstimator(mtbf_s=3600.0, initial_steps=50, alpha=0.5, clock=clock)
    assert est.interval_steps() == 50
    est.observe_checkpoint(10.0)
    assert est.interval_steps() == 50  # no step time yet
    est.observe_step(1.0)
    assert est.interval_steps() == auto_steps(10.0, 3600.0, 1.0)
    est.observe_checkpoint(20.0)  # ewma 15
    est.observe_step(3.0)  # ewma 2
    assert est.interval_steps() == auto_steps(15.0, 3600.0, 2.0)


def test_estimator_mtbf():
    clock = Clock()
    est = IntervalEstimator(mtbf_s=3600.0, clock=clock)
    est.observe_checkpoint(5.0)
    est.observe_step(0.5)
    clock.t += 100
    est.observe_failure()
    assert est.mtbf_s() == 3600.0  # one failure: configured
    clock.t += 100
    est.observe_failure(clock.t)
    assert est.mtbf_s() == pytest.approx(100.0)  # 200 s, 2 failures
    assert est.interval_steps() == auto_steps(5.0, 100.0, 0.5)
    clock.t += 200
    assert est.mtbf_s() == pytest.approx(200.0)


@pytest.mark.parametrize(
    "kw", [dict(mtbf_s=0.0), dict(mtbf_s=1.0, initial_steps=0), dict(mtbf_s=1.0, alpha=0.0), dict(mtbf_s=1.0, alpha=1.5)]
)
def test_estimator_rejects(kw):
    with pytest.raises(ConfigError):
        IntervalEstimator(**kw)


def test_estimator_rejects_observations():
    est = IntervalEstimator(mtbf_s=1.0, clock=Clock())
    with pytest.raises(ConfigError):
        est.observe_checkpoint(-1.0)
    with pytest.raises(ConfigError):
        est.observe_step(0.0)


# -- parse_tiers / defaults ---------------------------------------------------------


def test_parse_tiers_roundtrip():
    specs = parse_tiers(
        [
            {"name": "L0", "storage": "memory", "interval_steps": 5},
            {"name": "L1", "storage": "local", "interval_s": 60, "redundancy": "XOR", "group_size": 3, "path": "/t/{rank}"},
            {"name": "L2", "storage": "shared", "every_kth": 4, "path": "{job_dir}", "keep": 3, "keep_every": 1000},
            {"name": "A", "storage": "memory", "auto": True, "interval_s": None},
        ]
    )
    assert specs[1] == TierSpec(
        name="L1", storage="local", interval_s=60.0, redundancy=Redundancy.XOR, group_size=3, path="/t/{rank}"
    )
    assert isinstance(specs[1].interval_s, float)
    assert specs[2].keep_every == 1000 and specs[3].auto
    assert parse_tiers([]) == ()


@pytest.mark.parametrize(
    "raw, msg",
    [
        ([{"name": "L0", "storage": "memory", "interval_steps": 1, "every": 2}], "unknown key 'tiers[0].every'; valid keys: name, storage,"),
        ([{"storage": "memory", "interval_steps": 1}], "tiers[0] needs 'name'"),
        ([{"name": "x", "interval_steps": 1}], "tiers[0] needs 'storage'"),
        ([{"name": "x", "storage": "tape", "interval_steps": 1}], "storage='tape' must be one of"),
        ([{"name": "x", "storage": "memory", "interval_steps": 1}] * 2, "duplicate tier name 'x'"),
        ([{"name": "x", "storage": "memory", "interval_steps": 1, "redundancy": "partner"}], "needs storage 'local'"),
        ([{"name": "x", "storage": "local", "path": "p", "interval_steps": 1, "redundancy": "raid6"}], "redundancy='raid6' must be one of none, partner, xor"),
        ([{"name": "x", "storage": "memory", "interval_steps": "10"}], "tiers[0].interval_steps must be an integer"),
        ([{"name": "x", "storage": "memory", "interval_steps": True}], "must be an integer"),
        ([{"name": "x", "storage": "memory", "interval_s": "1m"}], "interval_s must be a number"),
        ([{"name": "x", "storage": "memory", "auto": "yes"}], "auto must be true or false"),
        ([{"name": 3, "storage": "memory", "interval_steps": 1}], "tiers[0].name must be a string"),
        ([{"name": "x", "storage": "shared", "path": "p", "every_kth": 2}], "every_kth drains a local or memory tier"),
        (["L0"], "tiers[0] must be a mapping"),
        ("L0", "tiers must be a list of mappings"),
    ],
)
def test_parse_tiers_errors(raw, msg):
    with pytest.raises(ConfigError) as e:
        parse_tiers(raw)
    assert msg in str(e.value)
    assert "\n" not in str(e.value)


def test_check_tiers():
    check_tiers(default_tiers())
    with pytest.raises(ConfigError, match="duplicate"):
        check_tiers([L0, L0])


def test_default_tiers():
    l0, l1, l2 = default_tiers()
    assert (l0.name, l0.storage, l0.interval_steps) == ("L0", "memory", 10)
    assert (l1.storage, l1.interval_steps, l1.redundancy) == ("local", 10, Redundancy.PARTNER)
    assert l1.path == "/tmp/slurm_resilience-{user}/{job_id}/{run_id}/{node}/ckpt"
    assert (l2.storage, l2.every_kth, l2.keep, l2.path) == ("shared", 5, 2, "{job_dir}/checkpoints")
    out = _run(default_tiers(), range(1, 101))
    assert [s for s, n in out.items() if "L2" in n] == [50, 100]
    assert [s for s, n in out.items() if n] == list(range(10, 101, 10))
