"""The recovery ladder is a pure function: every combination of inputs is checked."""

import itertools

import pytest

from slurm_resilience.model import FaultKind
from slurm_resilience.supervisor.decide.ladder import (
    FaultCase, LadderInput, LadderPolicy, Level, choose_level, plan_recovery,
)

PROCESS = (FaultKind.PROCESS_DIED, FaultKind.PROCESS_HUNG)
NODE = (FaultKind.NODE_LOST, FaultKind.NODE_UNHEALTHY)


def expected(inp: LadderInput) -> Level:
    """An independent statement of the rules."""
    order = []
    if inp.timed_out:  # only levels that relaunch every process remain
        order += [Level.PROCESS_RESTART, Level.REQUEUE]
    else:
        if inp.fault in PROCESS and inp.retries_used < inp.retry_budget:
            order += [Level.ONLINE, Level.PROCESS_RESTART]
        # a process fault past its budget takes its node only with node-level evidence
        if inp.fault not in PROCESS or inp.retries_used < inp.retry_budget or inp.node_suspect:
            order += [Level.NODE_REPLACEMENT, Level.SCALE_IN]
        order += [Level.REQUEUE]
    ok = {
        Level.ONLINE: inp.online,
        Level.PROCESS_RESTART: inp.relaunch,
        Level.NODE_REPLACEMENT: inp.spares_left >= inp.lost_nodes,
        Level.SCALE_IN: inp.scale_in and inp.world_size - inp.lost >= inp.min_world_size,
        Level.REQUEUE: inp.requeues_used < inp.max_requeues,
    }
    for level in order:
        if level not in inp.failed and ok[level]:
            return level
    return Level.FAIL


FAILED_SETS = [frozenset(), frozenset({Level.ONLINE}), frozenset({Level.ONLINE, Level.PROCESS_RESTART}),
               frozenset({Level.NODE_REPLACEMENT}), frozenset({Level.NODE_REPLACEMENT, Level.SCALE_IN})]


@pytest.mark.parametrize("fault", list(FaultKind))
def test_exhaustive(fault):
    n = 0
    for spares, used, budget, world, minw, scale, relaunch, rq_used, rq_max, failed, online, timed_out, suspect in \
            itertools.product((0, 1, 2), (0, 2, 3), (0, 3), (1, 2, 4), (1, 3), (True, False), (True, False),
                              (0, 1), (0, 1), FAILED_SETS, (True, False), (False, True), (False, True)):
        inp = LadderInput(fault=fault, spares_left=spares, retries_used=used, retry_budget=budget,
                          world_size=world, min_world_size=minw, scale_in=scale, relaunch=relaunch,
                          requeues_used=rq_used, max_requeues=rq_max, failed=failed, online=online,
                          timed_out=timed_out, node_suspect=suspect)
        d = choose_level(inp)
        assert d.level is expected(inp), inp
        assert d.reason
        n += 1
    assert n > 1000


def test_fail_reason_names_every_level_it_skipped():
    d = choose_level(LadderInput(fault=FaultKind.NODE_LOST, spares_left=0, retries_used=0, retry_budget=3,
                                 world_size=4, scale_in=False, max_requeues=0))
    assert d.level is Level.FAIL
    assert "no spare left" in d.reason and "scale-in disabled" in d.reason and "requeue" in d.reason


def test_incident_hands_out_spares_in_order_then_scales_in():
    cases = [FaultCase(1, "n2", FaultKind.NODE_LOST), FaultCase(2, "n3", FaultKind.NODE_LOST),
             FaultCase(3, "n4", FaultKind.PROCESS_DIED)]
    p = plan_recovery(cases, spares=["n6"], world_size=5, policy=LadderPolicy(retry_budget=3))
    assert p.level is Level.SCALE_IN
    assert p.spares == ((1, "n6"),) and p.lost == (2,) and p.restarts == (3,)
    assert p.isolate == ("n2", "n3")


def test_incident_needing_requeue_requeues_as_a_whole():
    cases = [FaultCase(1, "n2", FaultKind.NODE_LOST), FaultCase(2, "n3", FaultKind.NODE_LOST)]
    p = plan_recovery(cases, spares=["n6"], world_size=2,
                      policy=LadderPolicy(retry_budget=3, scale_in=True, min_world_size=2, max_requeues=1))
    assert p.level is Level.REQUEUE and not p.spares and not p.lost


def test_budget_spent_on_a_healthy_node_never_costs_the_node():
    """Issue 22: past the restart budget a rank's death on a reachable, healthy node
    ends the job (no requeue budget) and takes no node out of service."""
    p = plan_recovery([FaultCase(0, "n2", FaultKind.PROCESS_DIED)], spares=["n6"],
                      world_size=4, policy=LadderPolicy(retry_budget=3), retries_used=3)
    assert p.level is Level.FAIL and p.isolate == () and p.spares == ()
    assert "never costs its node" in p.reason


def test_budget_spent_with_node_evidence_treats_node_as_bad():
    p = plan_recovery([FaultCase(0, "n2", FaultKind.PROCESS_DIED, node_suspect=True)], spares=["n6"],
                      world_size=4, policy=LadderPolicy(retry_budget=3), retries_used=3)
    assert p.level is Level.NODE_REPLACEMENT and p.isolate == ("n2",) and p.spares == ((0, "n6"),)


def test_a_whole_step_fault_gets_no_spare_and_its_hostlist_is_not_isolated():
    """Relaunch mode: a non-zero exit of the all-ranks step names no rank and no single node."""
    p = plan_recovery([FaultCase(None, "n[2-4]", FaultKind.PROCESS_DIED)], spares=["n6"], world_size=3,
                      policy=LadderPolicy(retry_budget=1, online=False, scale_in=False), retries_used=1)
    assert p.level is Level.FAIL and p.isolate == () and "step on n[2-4]" in p.reason


def test_after_a_time_out_only_relaunching_levels_remain():
    inp = dict(fault=FaultKind.NODE_LOST, spares_left=2, retries_used=0, retry_budget=3, world_size=4,
               max_requeues=1, timed_out=True)
    assert choose_level(LadderInput(**inp)).level is Level.PROCESS_RESTART
    d = choose_level(LadderInput(**inp, failed=frozenset({Level.PROCESS_RESTART})))
    assert d.level is Level.REQUEUE
    d = choose_level(LadderInput(**{**inp, "max_requeues": 0}, failed=frozenset({Level.PROCESS_RESTART})))
    assert d.level is Level.FAIL and "node-replacement keeps survivors" in d.reason


def test_shrink_then_grow_keeps_survivor_order():
    from slurm_resilience.model import RankSlot, RankTable
    from slurm_resilience.supervisor.decide.ranktable import grow, shrink

    t = RankTable(generation=3, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=f"w{i}") for i in range(4)))
    s = shrink(t, [1])
    assert [x.node for x in s.slots] == ["n0", "n2", "n3"] and [x.rank for x in s.slots] == [0, 1, 2]
    g = grow(s, "n1", ["w9"], {"n1": "10.0.0.1"})
    assert g.generation == s.generation + 1 and g.slots[-1].rank == 3 and g.slots[-1].worker_id == "w9"
    assert g.slots[-1].address == "10.0.0.1"


def test_levels_and_marks_travel_as_their_strings():
    """events.jsonl's ``level`` values are the enum's values, unchanged; so are the marks."""
    import json

    from slurm_resilience.supervisor.decide.ladder import RUNGS
    from slurm_resilience.supervisor.decide.report import Mark

    assert [lv.value for lv in Level] == ["online", "process-restart", "node-replacement", "scale-in", "requeue",
                                           "fail", "straggler-migration", "scale-out"]
    assert set(RUNGS) == set(Level) - {Level.STRAGGLER_MIGRATION, Level.SCALE_OUT}
    assert json.dumps({"level": Level.SCALE_IN}) == '{"level": "scale-in"}' and Level.SCALE_IN == "scale-in"
    assert f"{Level.NODE_REPLACEMENT}" == str(Level.NODE_REPLACEMENT) == "node-replacement"
    assert [m.value for m in Mark] == ["detected", "classified", "replaced", "published", "reconnected", "restored",
                                       "first_step"]
