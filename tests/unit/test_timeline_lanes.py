"""timeline_lanes: what the timeline picture draws, from an event log (pure)."""

from slurm_resilience.timeline_lanes import lanes, recoveries, step_series

EVENTS = [
    {"t": 100.0, "kind": "plan", "generation": 0, "nodes": ["n1", "n2"]},
    {"t": 100.0, "kind": "job_start", "ranks": ["n1", "n2"], "spares": ["n3"]},
    {"t": 101.0, "kind": "rank_first_step", "rank": 0, "step": 1},
    {"t": 101.0, "kind": "rank_first_step", "rank": 1, "step": 1},
    {"t": 102.0, "kind": "rank_checkpoint_saved", "rank": 0, "step": 10, "stall_ms": 100.0},
    {"t": 103.0, "kind": "fault_detected", "observed_at": 103.0, "fault": {"rank": 1, "node": "n2", "time": 103.001}},
    {"t": 103.0, "kind": "recovery_start", "recovery": 1},
    {"t": 103.05, "kind": "plan", "generation": 1, "nodes": ["n1", "n3"]},
    {"t": 103.1, "kind": "phase", "recovery": 1, "phase": "reconnect", "start": 103.01, "end": 103.05},
    {"t": 103.1, "kind": "phase", "recovery": 1, "phase": "classify", "start": 103.0, "end": 103.01},
    {"t": 103.2, "kind": "recovery_done", "recovery": 1, "level": "node-replacement", "detected": 103.0,
     "first_step": 103.2},
    {"t": 105.0, "kind": "rank_done", "rank": 0, "step": 40},
    {"t": 105.0, "kind": "rank_done", "rank": 1, "step": 40},
]


def test_recoveries_carry_phases_in_order_and_the_fault():
    (rec,) = recoveries(EVENTS)
    assert (rec.number, rec.level, rec.rank, rec.node) == (1, "node-replacement", 1, "n2")
    assert [p[0] for p in rec.phases] == ["classify", "reconnect"]
    assert rec.fault_at == 103.0 and not rec.injected  # the first sign: observed_at
    (given,) = recoveries(EVENTS, {1: 102.5})
    assert given.fault_at == 102.5 and given.injected


def test_lanes_per_rank_with_nodes_states_and_the_spare():
    ls = {lane.label: lane.spans for lane in lanes(EVENTS, {1: 102.5})}
    assert set(ls) == {"rank 0: n1", "rank 1: n2 → n3", "spare: n3"}
    r0 = ls["rank 0: n1"]
    assert r0[0] == (100.0, 101.0, "starting")
    assert (101.9, 102.0, "checkpoint") in [(round(a, 3), b, s) for a, b, s in r0]
    assert (102.5, 103.2, "recovering") in r0 and r0[-1] == (103.2, 105.0, "training")
    r1 = ls["rank 1: n2 → n3"]
    assert (102.5, 103.0, "lost") in r1 and (103.0, 103.2, "recovering") in r1
    assert ls["spare: n3"] == ((100.0, 103.05, "standby"),)
    for spans in ls.values():  # contiguous, no overlaps
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_step_series_per_rank_in_time_order():
    s = step_series(EVENTS)
    assert s[0] == [(101.0, 1), (102.0, 10), (105.0, 40)] and s[1] == [(101.0, 1), (105.0, 40)]
