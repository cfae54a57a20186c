from hypothesis import given, strategies as st

from slurm_resilience.supervisor.observe.straggler import StragglerPolicy, StragglerWatch, slow_ranks

P = StragglerPolicy(threshold=1.5, window=3, min_ms=1.0)


def test_one_slow_rank_among_equals():
    assert slow_ranks({0: 10.0, 1: 30.0, 2: 10.5, 3: 9.8}, P) == {1}


def test_noise_below_min_ms_is_ignored():
    assert slow_ranks({0: 0.1, 1: 0.9, 2: 0.1}, P) == set()


def test_needs_window_consecutive_checks_and_reports_once():
    w = StragglerWatch(P)
    fast, slow = {0: 10.0, 1: 30.0, 2: 10.0}, {0: 10.0, 1: 10.0, 2: 10.0}
    assert w.observe(fast) == [] and w.observe(fast) == []
    assert w.observe(slow) == []  # streak broken
    assert w.observe(fast) == [] and w.observe(fast) == [] and w.observe(fast) == [1]
    assert w.observe(fast) == []  # reported once


@given(st.lists(st.floats(min_value=1.0, max_value=1000.0), min_size=2, max_size=16))
def test_equal_times_are_never_slow(times):
    same = {r: times[0] for r in range(len(times))}
    assert slow_ranks(same, P) == set()


def test_a_new_generation_starts_the_streaks_afresh():
    w = StragglerWatch(StragglerPolicy(threshold=1.5, window=2))
    fast, slow1 = {0: 10.0, 1: 10.0, 2: 10.0}, {0: 10.0, 1: 30.0, 2: 10.0}
    assert w.observe(slow1, 1) == []  # streak 1 for rank 1
    assert w.observe(slow1, 2) == []  # generation 2: rank 1 may be another process; its streak restarts
    assert w.observe(slow1, 2) == [1]
    assert w.observe(fast, 3) == [] and w.observe(slow1, 3) == [] and w.observe(slow1, 3) == [1]  # reported anew
