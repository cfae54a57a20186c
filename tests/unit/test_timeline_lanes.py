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
    assert set(ls) == {"rank 0: n1", "rank 1: n2 → n3", "spare: n3 → rank 1"}
    r0 = ls["rank 0: n1"]
    assert r0[0] == (100.0, 101.0, "starting")
    assert (101.9, 102.0, "checkpoint") in [(round(a, 3), b, s) for a, b, s in r0]
    assert (102.5, 103.2, "recovering") in r0 and r0[-1] == (103.2, 105.0, "training")
    r1 = ls["rank 1: n2 → n3"]
    assert (102.5, 103.0, "lost") in r1 and (103.0, 103.2, "recovering") in r1
    assert ls["spare: n3 → rank 1"] == ((100.0, 103.05, "standby"),)
    for spans in ls.values():  # contiguous, no overlaps
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_step_series_per_rank_in_time_order():
    s = step_series(EVENTS)
    assert s[0] == [(101.0, 1), (102.0, 10), (105.0, 40)] and s[1] == [(101.0, 1), (105.0, 40)]


def test_injected_faults_go_to_the_recovery_that_answered_them():
    from slurm_resilience.timeline_lanes import injected_fault_times

    events = EVENTS + [{"t": 104.6, "kind": "recovery_done", "recovery": 2, "level": "online", "detected": 104.5,
                        "first_step": 104.6}]
    injections = [{"fault": "freeze-node", "at": 101.0}, {"fault": "kill-node", "at": 101.5},  # one incident
                  {"fault": "corrupt-checkpoint", "at": 104.0},  # answered by no recovery
                  {"fault": "kill-rank", "at": 104.4},
                  {"fault": "kill-rank", "at": 106.0}]  # after every recovery: none to answer it
    assert injected_fault_times(events, injections) == {1: 101.0, 2: 104.4}
    assert injected_fault_times(events, []) == {}


# G = 2: ranks 0, 1 on n1 and 2, 3 on n2; n2 lost silently, the spare n3 takes ranks 2 and 3
G2 = [
    {"t": 100.0, "kind": "plan", "generation": 0, "nodes": ["n1", "n1", "n2", "n2"]},
    {"t": 100.0, "kind": "job_start", "spares": ["n3"]},
    *({"t": 101.0, "kind": "rank_first_step", "rank": r, "step": 1} for r in range(4)),
    {"t": 105.0, "kind": "fault_detected", "observed_at": 105.0,
     "fault": {"kind": "node_lost", "rank": 2, "node": "n2"}},
    {"t": 105.01, "kind": "plan", "generation": 1, "nodes": ["n1", "n1", "n3", "n3"]},
    {"t": 105.1, "kind": "recovery_done", "recovery": 1, "level": "node-replacement", "detected": 105.0,
     "first_step": 105.1},
    *({"t": 107.0, "kind": "rank_done", "rank": r, "step": 40} for r in range(4)),
]


def test_a_lost_node_paints_every_rank_it_held_lost_and_names_the_spare_that_took_them():
    ls = {lane.label: lane.spans for lane in lanes(G2, {1: 103.0})}
    assert set(ls) == {"rank 0: n1", "rank 1: n1", "rank 2: n2 → n3", "rank 3: n2 → n3", "spare: n3 → rank 2, 3"}
    for r in (2, 3):
        assert (103.0, 105.0, "lost") in ls[f"rank {r}: n2 → n3"]
    for r in (0, 1):
        assert (103.0, 105.1, "recovering") in ls[f"rank {r}: n1"]
        assert all(s != "lost" for _, _, s in ls[f"rank {r}: n1"])
    # a process fault loses its rank only, not the other ranks of its node
    proc = [dict(e, fault={"kind": "process_died", "rank": 2, "node": "n2"}) if e["kind"] == "fault_detected" else e
            for e in G2]
    spans = {lane.label: lane.spans for lane in lanes(proc, {1: 103.0})}
    assert (103.0, 105.0, "lost") in spans["rank 2: n2 → n3"]
    assert all(s != "lost" for _, _, s in spans["rank 3: n2 → n3"])


def test_the_recovery_panel_breaks_its_axis_only_when_detection_dominates(tmp_path):
    from slurm_resilience.timeline_plot import breaks_axis, plot_timeline

    (silent,) = recoveries(G2, {1: 103.0})  # 2 s to detect, then 0.1 s
    (killed,) = recoveries(G2, {1: 104.97})  # 30 ms to detect, then 0.1 s
    (seen,) = recoveries(G2)  # no injection time: the first sign is the detection
    assert breaks_axis(silent) and not breaks_axis(killed) and not breaks_axis(seen)
    data = open(plot_timeline(G2, str(tmp_path / "silent.png"), {1: 103.0}), "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert [p.name for p in tmp_path.iterdir()] == ["silent.png"]  # no temporary file left
