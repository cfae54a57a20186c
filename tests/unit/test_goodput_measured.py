"""The model's validation against real runs: fault schedule, event readers, closed form
with overlapping recoveries, the collective's position in a step."""

import numpy as np
import pytest

from slurm_resilience.errors import ConfigError
from slurm_resilience.simulate.goodput import (
    CheckpointSpec, Cluster, FailureCategory, FailureModel, FaultClass, RecoveryPath, Rollback, Strategy,
    expected_ettr, simulate, validate_against_run,
)
from slurm_resilience.simulate.measured import (
    IncompleteRunError, Stretch, mean_phases_ms, observed_ettr, poisson_schedule, productive_step_time,
    recovery_phases_ms, training_stretches, training_window,
)

ONE = Cluster(gpus=1, gpus_per_node=1)
KILL = "kill"
MODEL = FailureModel(categories=(FailureCategory(name=KILL, share=1.0, fault_class=FaultClass.PROCESS),),
                     interruptions=1.0, period_s=10.0, reference_gpus=1)


def _strategy(downtime_s, step_s=1.0, collective_at=1.0):
    path = RecoveryPath(name="restart", downtime_s=downtime_s, rollback=Rollback.STEP)
    return Strategy(name="s", step_time_s=step_s, checkpoint=CheckpointSpec(interval_s=1e9, cost_s=0.0),
                    on_node=path, on_process=path, on_hang=path, on_no_spare=path, collective_at=collective_at)


# -- the fault schedule ---------------------------------------------------------------

def test_poisson_schedule_is_seeded_sorted_and_in_the_horizon():
    a = poisson_schedule(mean_interval_s=8.0, horizon_s=120.0, seed=3)
    assert a == poisson_schedule(mean_interval_s=8.0, horizon_s=120.0, seed=3)
    assert a != poisson_schedule(mean_interval_s=8.0, horizon_s=120.0, seed=4)
    assert list(a) == sorted(a) and all(0 <= t < 120.0 for t in a)


def test_poisson_schedule_has_the_mean_rate():
    counts = [len(poisson_schedule(mean_interval_s=5.0, horizon_s=1000.0, seed=s)) for s in range(50)]
    assert np.mean(counts) == pytest.approx(200.0, abs=4 * np.sqrt(200 / 50))
    gaps = np.diff(poisson_schedule(mean_interval_s=5.0, horizon_s=50_000.0, seed=0))
    assert gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert np.std(gaps) == pytest.approx(5.0, rel=0.05)  # exponential: std == mean


def test_poisson_schedule_rejects_bad_input():
    with pytest.raises(ConfigError):
        poisson_schedule(mean_interval_s=0.0, horizon_s=10.0, seed=0)
    with pytest.raises(ConfigError):
        poisson_schedule(mean_interval_s=1.0, horizon_s=-1.0, seed=0)


# -- reading a run's events ---------------------------------------------------------

def _run_events():
    ev = [{"t": 100.0, "kind": "plan", "generation": 0}]
    ev += [{"t": 103.0 + r / 100, "kind": "rank_restored", "generation": 0, "rank": r, "step": 0} for r in range(3)]
    ev += [{"t": 110.5, "kind": "recovery_start", "recovery": 1},
           {"t": 113.0, "kind": "rank_restored", "generation": 1, "rank": 0, "step": 70}]
    marks = [110.5, 110.502, 110.503, 110.51, 113.0, 113.02, 113.12]
    names = ["classify", "replace", "ranktable", "reconnect", "restore", "first_step"]
    ev += [{"t": 113.12, "kind": "phase", "recovery": 1, "phase": n, "start": s, "end": e}
           for n, s, e in zip(names, marks, marks[1:])]
    ev += [{"t": 113.12, "kind": "recovery_done", "recovery": 1, "detected": 110.5, "first_step": 113.12},
           # a recovery a newer fault superseded: phases but no recovery_done
           {"t": 120.0, "kind": "phase", "recovery": 2, "phase": "classify", "start": 120.0, "end": 120.001}]
    ev += [{"t": 140.0 + r / 100, "kind": "rank_done", "generation": 3, "rank": r, "step": 300} for r in range(3)]
    return ev


def test_training_window_runs_from_the_last_restore_to_the_last_done():
    w = training_window(_run_events())
    assert (w.start, w.end, w.steps) == (103.02, 140.02, 300)
    assert w.wall_s == pytest.approx(37.0)


def test_training_window_of_an_unfinished_run_is_an_error():
    with pytest.raises(IncompleteRunError, match="did it finish"):
        training_window([e for e in _run_events() if e["kind"] != "rank_done"])


def test_observed_ettr():
    assert observed_ettr(steps=300, step_time_s=0.1, wall_s=37.0) == pytest.approx(30.0 / 37.0)
    with pytest.raises(ConfigError):
        observed_ettr(steps=300, step_time_s=0.0, wall_s=37.0)


def _stretches(restores, done_t, done_step, world=2):
    """Events of a run: generation -> (restore time, step) for every rank; done at the end."""
    ev = [{"t": t, "kind": "rank_restored", "generation": g, "rank": r, "step": s}
          for g, (t, s) in restores.items() for r in range(world)]
    return ev + [{"t": done_t, "kind": "rank_done", "generation": max(restores), "rank": r, "step": done_step}
                 for r in range(world)]


def test_productive_step_time_without_faults_is_window_over_steps():
    got = productive_step_time(_stretches({0: (100.0, 0)}, 130.0, 250))
    assert got.step_s == pytest.approx(30.0 / 250) and (got.stretches, got.left_out) == (1, 0)


def test_productive_step_time_after_the_collective():
    # 0.1 s steps; a fault 100.5 steps in; the survivors finish step 101 and stop:
    # generation 1 restores step 101 at 113 and trains 100 more steps to the end.
    ev = _stretches({0: (100.0, 0), 1: (113.0, 101)}, 123.0, 201)
    assert productive_step_time(ev, [110.05], collective_at=0.0).step_s == pytest.approx(0.1)
    assert training_stretches(ev, [110.05], collective_at=0.0) == [Stretch(pytest.approx(10.05), 100.5),
                                                                     Stretch(10.0, 100)]
    # window / steps would count the 3 s recovery as training
    assert training_window(ev).wall_s / 201 == pytest.approx(23.0 / 201)


def test_productive_step_time_before_the_collective():
    # the same fault before the collective: step 101 is aborted, generation 1 restores 100
    ev = _stretches({0: (100.0, 0), 1: (113.0, 100)}, 123.0, 200)
    assert productive_step_time(ev, [110.05], collective_at=1.0).step_s == pytest.approx(0.1)


def test_productive_step_time_fault_during_recovery_and_fault_free_reform():
    # fault at 110.05 -> generation 1 restored at 113 (step 101); a second fault at 111
    # (during that recovery) starts no stretch; generation 2 re-forms at 120 with no
    # fault (e.g. a straggler moved); the run ends at 130 with step 271.
    ev = _stretches({0: (100.0, 0), 1: (113.0, 101), 2: (120.0, 171)}, 130.0, 271)
    got = productive_step_time(ev, [110.05, 111.0], collective_at=0.0)
    assert got.step_s == pytest.approx((10.05 + 7.0 + 10.0) / (270.5), rel=1e-9)
    assert got.step_s == pytest.approx(0.1) and got.stretches == 3


def test_productive_step_time_leaves_out_a_stretch_with_a_stall():
    # 0.1 s steps, a fault 100.5 steps into each stretch; generation 2's stretch also
    # holds a 15 s stall (a blocked checkpoint): 100.5 steps in 25.05 s.
    ev = _stretches({0: (100.0, 0), 1: (113.0, 101), 2: (126.0, 202), 3: (154.0, 303)}, 164.0, 403)
    faults = [110.05, 123.05, 151.05]
    pooled = (10.05 + 10.05 + 25.05 + 10.0) / (100.5 * 3 + 100)
    assert pooled == pytest.approx(0.137, abs=1e-3)
    got = productive_step_time(ev, faults, collective_at=0.0)
    assert got.step_s == pytest.approx(0.1) and (got.stretches, got.left_out) == (4, 1)
    with pytest.raises(ConfigError):
        productive_step_time(ev, faults, slow_factor=0.5)


def test_productive_step_time_errors():
    ev = _stretches({0: (100.0, 0)}, 130.0, 250)
    with pytest.raises(ConfigError):
        productive_step_time(ev, collective_at=-0.1)
    with pytest.raises(IncompleteRunError, match="no generation restored after"):
        productive_step_time(ev, [110.0])
    with pytest.raises(IncompleteRunError):
        productive_step_time([e for e in ev if e["kind"] != "rank_done"])


def test_recovery_phases_take_detect_from_the_newest_fault_before_detection():
    rows = recovery_phases_ms(_run_events(), fault_times=[90.0, 110.48, 111.0])
    assert len(rows) == 1  # the superseded recovery 2 is skipped
    row = rows[0]
    assert list(row) == ["detect", "classify", "replace", "ranktable", "reconnect", "restore", "first_step"]
    assert row["detect"] == pytest.approx(20.0)
    assert row["reconnect"] == pytest.approx(2490.0) and row["first_step"] == pytest.approx(100.0)
    assert "detect" not in recovery_phases_ms(_run_events())[0]


def test_recovery_without_its_phases_is_an_error():
    ev = [e for e in _run_events() if not (e["kind"] == "phase" and e["phase"] == "restore")]
    with pytest.raises(IncompleteRunError, match="restore"):
        recovery_phases_ms(ev)


def test_mean_phases():
    rows = [{"detect": 10.0, "reconnect": 2000.0}, {"reconnect": 3000.0}]
    assert mean_phases_ms(rows) == {"detect": 10.0, "reconnect": 2500.0}
    assert mean_phases_ms([]) == {}


# -- the collective's position in a step ----------------------------------------------

def test_fault_before_the_collective_loses_the_partial_step():
    # step 6 s; fault at t=1000 is 4 s (2/3) into a step; downtime 10 s.
    r = simulate(ONE, MODEL, _strategy(10.0, step_s=6.0, collective_at=0.9), 3600, injected=[(1000.0, KILL)])
    assert (r.lost_work_s, r.recovery_s, r.productive_s) == pytest.approx((4.0, 10.0, 3586.0))


def test_fault_after_the_collective_lets_the_survivors_finish_the_step():
    r = simulate(ONE, MODEL, _strategy(10.0, step_s=6.0, collective_at=0.5), 3600, injected=[(1000.0, KILL)])
    # the last 2 s of the step are trained during the recovery
    assert (r.lost_work_s, r.recovery_s, r.productive_s) == pytest.approx((0.0, 8.0, 3592.0))
    assert r.productive_s + r.lost_work_s + r.recovery_s + r.checkpoint_s == pytest.approx(r.wall_s)


def test_collective_at_is_checked():
    with pytest.raises(ConfigError, match="collective_at"):
        _strategy(1.0, collective_at=1.5)


# -- closed form with overlapping recoveries --------------------------------------

def test_expected_ettr_one_fault_by_hand():
    got = expected_ettr(wall_s=60.0, faults=1, downtime_s=2.0, step_time_s=0.1, checkpoint_interval_s=1.0)
    assert got == pytest.approx((60 - 2.0 - 0.05) / 60)
    got = expected_ettr(wall_s=60.0, faults=1, downtime_s=2.0, step_time_s=0.1, checkpoint_interval_s=1.0,
                        collective_at=0.0)
    assert got == pytest.approx((60 - 2.0 + 0.05) / 60)
    assert expected_ettr(wall_s=60.0, faults=0, downtime_s=99.0, step_time_s=0.1, checkpoint_interval_s=1.0) == 1.0


@pytest.mark.parametrize("collective_at", [1.0, 0.0])
def test_expected_ettr_matches_simulation_when_recoveries_overlap(collective_at):
    # 100 faults of 10 s in 2000 s: a third of the faults land in a recovery.
    horizon, faults, downtime = 2000.0, 100, 10.0
    s = _strategy(downtime, step_s=1.0, collective_at=collective_at)
    rng = np.random.default_rng(0)
    sims = [simulate(ONE, MODEL, s, horizon, injected=[(t, KILL) for t in sorted(rng.uniform(0, horizon, faults))]).ettr
            for _ in range(60)]
    want = expected_ettr(wall_s=horizon, faults=faults, downtime_s=downtime, step_time_s=1.0,
                         checkpoint_interval_s=1e9, collective_at=collective_at)
    naive = 1 - faults * (downtime + (collective_at - 0.5)) / horizon
    assert np.mean(sims) == pytest.approx(want, abs=6e-3)
    assert abs(want - naive) > 0.05  # the additive form would be far off


def test_expected_ettr_rejects_bad_input():
    with pytest.raises(ConfigError):
        expected_ettr(wall_s=60.0, faults=1, downtime_s=2.0, step_time_s=0.1, checkpoint_interval_s=1.0,
                      collective_at=2.0)
    with pytest.raises(ConfigError):
        expected_ettr(wall_s=0.0, faults=1, downtime_s=2.0, step_time_s=0.1, checkpoint_interval_s=1.0)


# -- validate_against_run with a measured restart ---------------------------------

def test_validate_measured_process_restart_adds_nothing_modelled():
    # a process restart measured end to end: the reconnect phase holds the new process's start
    phases = {"detect": 20.0, "classify": 3.0, "replace": 0.0, "ranktable": 4.0, "reconnect": 2500.0,
              "restore": 20.0, "first_step": 110.0}
    base = {"wall_time_s": 100.0, "faults": 10, "phases_ms": phases, "step_time_s": 0.11,
            "checkpoint_interval_s": 1.1, "fault_class": "process"}
    out = validate_against_run({**base, "collective_at": 0.0, "ettr": 0.75})
    assert out["downtime_per_fault_s"] == pytest.approx(2.547)
    assert out["expected_lost_work_per_fault_s"] == pytest.approx(-0.055)
    assert out["predicted_ettr"] == pytest.approx(expected_ettr(
        wall_s=100.0, faults=10, downtime_s=2.547, step_time_s=0.11, checkpoint_interval_s=1.1, collective_at=0.0))
    assert out["difference"] == pytest.approx(0.75 - out["predicted_ettr"])
    assert validate_against_run(base)["downtime_per_fault_s"] == out["downtime_per_fault_s"]
