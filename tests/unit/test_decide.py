"""decide() is pure: every ladder level, fallback, budget and re-attach, with no Slurm, torch or files."""

import dataclasses

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.lifecycle import JobPhase
from slurm_resilience.model import Fault, FaultKind, RankTable
from slurm_resilience.protocol import EventKind, Plan, PlanAction, Role, WorkerEvent
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.decide import EXIT_FAILED, EXIT_OK, EXIT_REQUEUED, decide
from slurm_resilience.supervisor.executors.reattach import adopt_plans
from slurm_resilience.supervisor.decide.state import Mode, Policy, SupervisorState

WORKERS, SPARES = ("n2", "n3", "n4"), ("n5",)


def policy(mode=Mode.ONLINE, can_requeue=True, **recovery):
    # the path without local standbys; tests/unit/test_local_standbys.py covers them
    cfg = load_config({"recovery": {"online_timeout_s": 10, "fallback_timeout_s": 20, "local_standbys": False,
                                    **recovery}})
    return Policy.from_config(cfg, mode=mode, can_requeue=can_requeue)


def fresh(spares=SPARES, requeue_count=0):
    return SupervisorState(job_id="7", phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
                           target_world=len(WORKERS), worker_nodes=WORKERS, spare_nodes=tuple(spares),
                           addresses={n: f"10.0.0.{n[1:]}" for n in WORKERS + tuple(spares)},
                           requeue_count=requeue_count)


def ready(state, p):
    """Every standby connects and every spare passes its health check."""
    for node, wids in state.standbys.items():
        for w in wids:
            state, _ = decide(state, m.Connected(w, 100, 0.1), 0.1, p)
        state, _ = decide(state, m.SpareChecked(node, None, 0.2), 0.2, p)
    return state


def started(p=None, **kw):
    p = p or policy()
    state, acts = decide(fresh(**kw), m.Start(), 0.0, p)
    return ready(state, p), acts


def of(acts, cls):
    return [a for a in acts if isinstance(a, cls)]


def kinds(acts):
    return [a.kind for a in of(acts, m.Emit)]


def suspect(state, rank=None, node=None, standby=False, **flags):
    if standby:
        wid = state.standbys[node][0]
    else:
        wid = state.table.slots[rank].worker_id
    return m.Suspects((m.Suspect(worker_id=wid, t=1.0, **flags),))


def killed(state, rank):  # a process died on a healthy node
    return suspect(state, rank, process_exited=True, slurmd_reachable=True)


def lost(state, rank):  # the node is gone
    return suspect(state, rank, process_exited=True, slurmd_reachable=False)


def finish_recovery(state, p, now=3.0):
    """Every rank of the new generation reports its marks: the recovery closes."""
    acts_all = []
    for rank in range(state.table.world_size):
        for kind in (WorkerEvent.RECONNECTED, WorkerEvent.RESTORED, WorkerEvent.FIRST_STEP):
            state, acts = decide(state, m.WorkerMark(kind, rank, state.table.generation, 2.5), now, p)
            acts_all += acts
    return state, acts_all


def test_start_launches_ranks_and_standbys_and_publishes_generation_0():
    state, acts = started()
    plan = of(acts, m.Publish)[0].plan
    assert plan.generation == 0 and plan.action is PlanAction.RUN and plan.table.nodes == WORKERS
    launches = of(acts, m.Launch)
    assert [(a.node, a.role) for a in launches] == [(n, Role.RANK) for n in WORKERS] + [("n5", Role.STANDBY)]
    assert state.standbys == {"n5": (launches[-1].worker_id,)} and state.phase is JobPhase.RUNNING
    assert EventKind.JOB_START in kinds(acts)
    assert len({a.worker_id for a in launches}) == 4  # ids never repeat


def test_start_launches_every_step_before_the_plan_goes_out():
    """The workers' start (srun, import torch) overlaps the supervisor's store client:
    every Launch and job_start (its time: all launched) come before plan 0's Publish (the
    nodes' own standbys wait for the first step); the relaunch executor gets no Publish."""
    for p in (policy(), policy(local_standbys=True)):
        _, acts = decide(fresh(), m.Start(), 0.0, p)
        order = [type(a) for a in acts if isinstance(a, (m.Launch, m.Publish))]
        assert order == [m.Launch] * (len(order) - 1) + [m.Publish]
        assert len(order) - 1 == len(WORKERS) + len(SPARES)
        ks = kinds(acts)
        assert ks.index(EventKind.JOB_START) < ks.index(EventKind.PLAN)
        assert acts.index(of(acts, m.Publish)[0]) > max(acts.index(a) for a in of(acts, m.Launch))
    _, acts = decide(fresh(), m.Start(), 0.0, policy(mode=Mode.RELAUNCH))
    assert of(acts, m.Publish) == [] and len(of(acts, m.Relaunch)) == 1


def test_online_restart_in_place_then_recovery_closes_with_phases():
    p = policy()
    state, _ = started(p)
    old = state.table.slots[1].worker_id
    state, acts = decide(state, killed(state, 1), 1.1, p)
    assert kinds(acts)[:3] == [EventKind.FAULT_DETECTED, EventKind.LADDER, EventKind.PLAN]
    plan = of(acts, m.Publish)[0].plan
    assert plan.generation == 1 and plan.joining == (1,) and plan.table.slots[1].node == "n3"
    assert plan.table.slots[1].worker_id != old and [s.worker_id for s in plan.table.slots][::2] == \
        [s.worker_id for s in state.table.slots][::2]
    assert [(a.node, a.role, a.generation) for a in of(acts, m.Launch)] == [("n3", Role.RANK, 1)]
    assert state.fault_retries_used == 1 and state.recovery.level == "online" and not of(acts, m.Isolate)
    assert state.workers[old].dead and state.phase is JobPhase.RECOVERING
    state, acts = decide(state, m.Published(1, 1.2), 1.2, p)
    assert state.recovery.deadline == pytest.approx(11.2)
    state, acts = finish_recovery(state, p)
    assert kinds(acts).count(EventKind.PHASE) == 6 and EventKind.RECOVERY_DONE in kinds(acts)
    assert state.recovery is None and state.phase is JobPhase.RUNNING


def test_hung_rank_is_killed_before_its_restart():
    p = policy()
    state, _ = started(p)
    wid = state.table.slots[2].worker_id
    state, acts = decide(state, suspect(state, 2, heartbeat_stale=True, slurmd_reachable=True, still_running=True),
                         1.0, p)
    assert m.Kill(wid) in acts and state.recovery.level == "online"


def test_node_lost_adopts_the_standby_and_isolates_the_node():
    p = policy()
    state, _ = started(p)
    standby = state.standbys["n5"][0]
    state, acts = decide(state, lost(state, 1), 1.0, p)
    assert of(acts, m.Isolate) == [m.Isolate("n3", "auto", "slurm_resilience job 7: node_lost")]
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.slots[1].node == "n5" and plan.table.slots[1].worker_id == standby
    assert not of(acts, m.Launch)  # the standby is already running: no process start
    assert state.standbys == {} and "n3" in state.excluded and state.recovery.level == "node-replacement"
    assert state.fault_retries_used == 0  # a node replacement spends no retry


def test_budget_spent_turns_a_process_fault_into_a_node_replacement():
    p = policy(fault_retry_times=1)
    state, _ = started(p)
    state, _ = decide(state, killed(state, 0), 1.0, p)
    state, _ = decide(state, m.Published(1, 1.0), 1.0, p)
    state, _ = finish_recovery(state, p)
    state, acts = decide(state, killed(state, 0), 4.0, p)  # the budget counts per job
    assert state.recovery.level == "node-replacement" and of(acts, m.Isolate)[0].node == "n2"


def test_no_spare_scales_in_by_the_lost_rank():
    p = policy()
    state, _ = started(p, spares=())
    state, acts = decide(state, lost(state, 1), 1.0, p)
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.nodes == ("n2", "n4") and [s.rank for s in plan.table.slots] == [0, 1]
    assert state.recovery.level == "scale-in"


def test_below_min_world_requeues_then_fails_when_requeues_are_spent():
    p = policy(scale_in=True, min_world_size=3, max_requeues=1)
    state, _ = started(p, spares=())
    s2, acts = decide(state, lost(state, 1), 1.0, p)
    assert of(acts, m.Publish)[0].plan.action is PlanAction.STOP and m.Requeue() in acts
    assert acts[-1] == m.Exit(EXIT_REQUEUED) and s2.phase is JobPhase.FAILED
    state, _ = started(p, spares=(), requeue_count=1)
    s3, acts = decide(state, lost(state, 1), 1.0, p)
    assert of(acts, m.Publish)[0].plan.action is PlanAction.ABORT
    assert acts[-1].code == EXIT_FAILED and acts[-1].error.startswith("node n3 lost and no spare left")


def test_timeouts_fall_back_online_then_process_restart_then_requeue():
    p = policy(max_requeues=1)
    state, _ = started(p)
    state, acts = decide(state, killed(state, 1), 1.0, p)
    state, _ = decide(state, m.Published(1, 1.0), 1.0, p)
    state, acts = decide(state, m.Tick(), 5.0, p)
    assert acts == []  # before the deadline
    old = [s.worker_id for s in state.table.slots]
    state, acts = decide(state, m.Tick(), 11.5, p)  # online timed out
    assert EventKind.FALLBACK in kinds(acts) and EventKind.LADDER not in kinds(acts)
    assert {a.worker_id for a in of(acts, m.Kill)} == set(old)
    plan = of(acts, m.Publish)[0].plan
    assert plan.joining == (0, 1, 2) and plan.table.nodes == WORKERS and state.phase is JobPhase.FALLBACK_RELAUNCH
    assert len(of(acts, m.Launch)) == 3 and state.recovery.level == "process-restart"
    state, _ = decide(state, m.Published(2, 12.0), 12.0, p)
    assert state.recovery.deadline == pytest.approx(32.0)  # fallback_timeout_s
    state, acts = decide(state, m.Tick(), 33.0, p)  # process restart timed out too
    assert m.Requeue() in acts and acts[-1] == m.Exit(EXIT_REQUEUED)


def test_timeout_without_relaunch_or_requeue_fails():
    p = policy(fallback_relaunch=False, max_requeues=0)
    state, _ = started(p)
    state, _ = decide(state, lost(state, 1), 1.0, p)  # node replacement
    state, _ = decide(state, m.Published(1, 1.0), 1.0, p)
    state, acts = decide(state, m.Tick(), 20.0, p)
    assert acts[-1].code == EXIT_FAILED and "did not train a step" in acts[-1].error


def test_a_finished_rank_exiting_is_not_a_fault_and_all_done_finishes():
    p = policy()
    state, _ = started(p)
    state, acts = decide(state, suspect(state, 0, process_exited=True, finished=True), 1.0, p)
    assert acts == [] and state.recovery is None
    state, acts = decide(state, m.AllDone(), 2.0, p)
    assert m.ShutDownStandbys() in acts and acts[-1] == m.Exit(EXIT_OK) and state.phase is JobPhase.SUCCEEDED
    # the job is over: a standby still importing is ended, not waited for until it connects
    assert of(acts, m.Reap) == [m.Reap(30.0, end_unready=True)]


def test_all_done_waits_for_a_recovery_in_flight():
    p = policy()
    state, _ = started(p)
    state, _ = decide(state, killed(state, 1), 1.0, p)
    assert decide(state, m.AllDone(), 2.0, p)[1] == []


def test_preemption_persists_then_requeues():
    p = policy()
    state, _ = started(p)
    state, acts = decide(state, m.Preempted(), 1.0, p)
    plan = of(acts, m.Publish)[0].plan
    assert plan.action is PlanAction.PERSIST and plan.table.generation == 1
    assert acts[-1] == m.Exit(EXIT_REQUEUED)


def test_lost_standby_shrinks_the_pool_and_isolates_its_node():
    p = policy()
    state, _ = started(p)
    state, acts = decide(state, suspect(state, node="n5", standby=True, process_exited=True,
                                        slurmd_reachable=False), 1.0, p)
    assert state.standbys == {} and of(acts, m.Isolate)[0].node == "n5" and state.recovery is None


def test_scale_back_out_when_a_node_returns():
    p = policy()
    state, _ = started(p, spares=())
    state, _ = decide(state, lost(state, 1), 1.0, p)
    state, _ = decide(state, m.Published(1, 1.0), 1.0, p)
    state, _ = finish_recovery(state, p)
    state, acts = decide(state, m.NodeBack("n3", "IDLE"), 4.0, p)
    standby = of(acts, m.Launch)[0]
    assert standby.role is Role.STANDBY and "n3" not in state.excluded
    assert m.CheckSpare("n3") in acts  # a returning node is checked before it rejoins
    state, acts = decide(state, m.Connected(standby.worker_id, 99, 4.5), 4.5, p)
    assert not of(acts, m.Publish)  # connected, but not yet checked
    state, acts = decide(state, m.SpareChecked("n3", None, 4.6), 4.6, p)
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.world_size == 3 and plan.table.slots[-1].node == "n3" and state.recovery.level == "scale-out"


def test_straggler_is_migrated_only_when_configured():
    p = policy()
    state, _ = started(p)
    _, acts = decide(state, m.Straggler(2, 90.0, (10.0, 11.0)), 1.0, p)
    assert kinds(acts) == [EventKind.STRAGGLER] and not of(acts, m.Publish)
    p = policy(migrate_stragglers=True)
    state, _ = started(p)
    state, acts = decide(state, m.Straggler(2, 90.0, (10.0, 11.0)), 1.0, p)
    assert of(acts, m.Publish)[0].plan.table.slots[2].node == "n5" and of(acts, m.Isolate)[0].state == "DRAIN"


def test_illegal_phase_transition_is_a_bug_not_silence():
    from slurm_resilience.errors import RecoveryError
    from slurm_resilience.supervisor.decide.decide import move

    with pytest.raises(RecoveryError):
        move(fresh(), JobPhase.SUCCEEDED, "skipping ahead")


# ---------------------------------------------------------------- relaunch mode (unmodified programs)

def rfaults(state, *faults):
    return m.StepFaults(tuple(faults), 1.0, step="sr-restart-0")


def node_lost(node):
    return Fault(kind=FaultKind.NODE_LOST, rank=None, node=node, time=1.0, detail="slurmd unreachable")


STEP_DIED = Fault(kind=FaultKind.PROCESS_DIED, rank=None, node="n[2-4]", time=1.0, detail="exit code 1")


def test_relaunch_mode_node_lost_goes_to_the_spare_in_allocation_order():
    """Slurm numbers a step's tasks in allocation order, whatever -w says: so does the table."""
    p = policy(Mode.RELAUNCH)
    state, acts = started(p)
    assert [type(a) for a in acts if not isinstance(a, (m.Emit, m.Say, m.Phase))] == [m.Relaunch]
    state, acts = decide(state, rfaults(state, node_lost("n3")), 1.0, p)
    relaunch = of(acts, m.Relaunch)[0]
    assert relaunch.table.nodes == ("n2", "n4", "n5") and relaunch.attempt == 1
    assert of(acts, m.Isolate)[0].node == "n3" and state.phase is JobPhase.RUNNING
    assert not of(acts, m.Publish) and not of(acts, m.Launch)


def test_relaunch_mode_two_lost_two_spares_and_an_excluded_spare_is_skipped():
    p = policy(Mode.RELAUNCH)
    state, _ = started(p, spares=("n5", "n6", "n7"))
    state = dataclasses.replace(state, excluded=frozenset({"n5"}))
    state, acts = decide(state, rfaults(state, node_lost("n2"), node_lost("n4")), 1.0, p)
    assert of(acts, m.Relaunch)[0].table.nodes == ("n3", "n6", "n7")


def test_relaunch_mode_process_death_relaunches_in_place_within_the_budget_then_fails():
    p = policy(Mode.RELAUNCH, fault_retry_times=2)
    state, _ = started(p)
    for attempt in (1, 2):
        state, acts = decide(state, rfaults(state, STEP_DIED), 1.0, p)
        assert of(acts, m.Relaunch)[0].table.nodes == WORKERS and of(acts, m.Relaunch)[0].attempt == attempt
        assert not of(acts, m.Isolate)
    state, acts = decide(state, rfaults(state, STEP_DIED), 1.0, p)
    assert acts[-1].code == EXIT_FAILED and "the program's own snapshots are kept" in acts[-1].error
    assert m.Reap(0.0) in acts


def test_relaunch_mode_no_spare_left_fails_with_one_clear_reason():
    p = policy(Mode.RELAUNCH)
    state, _ = started(p, spares=())
    state, acts = decide(state, rfaults(state, node_lost("n3")), 1.0, p)
    assert acts[-1].error.startswith("node n3 lost and no spare left") and of(acts, m.Isolate)[0].node == "n3"


def test_relaunch_mode_has_no_online_level_no_scale_in_and_no_requeue():
    p = policy(Mode.RELAUNCH, max_requeues=3, scale_in=True)
    assert not p.ladder.online and not p.ladder.scale_in and p.ladder.max_requeues == 0


# ---------------------------------------------------------------- re-attach

def test_state_round_trips_and_a_recovery_in_flight_is_dropped():
    p = policy()
    state, _ = started(p)
    state, _ = decide(state, killed(state, 1), 1.0, p)
    back = SupervisorState.from_dict(state.to_dict())
    assert back.table == state.table and back.standbys == state.standbys and back.next_id == state.next_id
    assert back.fault_retries_used == 1 and back.recovery is None and back.phase is JobPhase.RUNNING
    assert {w: r.dead for w, r in back.workers.items()} == {w: r.dead for w, r in state.workers.items()}


def test_reattach_adopts_newer_plans_and_stops_at_a_gap_or_an_end():
    p = policy()
    state, _ = started(p)
    _, acts = decide(state, lost(state, 1), 1.0, p)
    plan1 = of(acts, m.Publish)[0].plan
    adopted = adopt_plans(state, [plan1])
    assert adopted.table == plan1.table and adopted.standbys == {}
    assert plan1.table.slots[1].worker_id in adopted.workers
    stop = Plan(generation=2, action=PlanAction.STOP, table=plan1.table)
    assert adopt_plans(state, [plan1, stop]).table == plan1.table
    assert adopt_plans(state, [stop]).table == state.table  # not the next generation: ignored


def test_a_spare_whose_standby_died_is_not_handed_out_cold():
    """Online, only a warm standby is a spare: its node without one is not adopted."""
    p = policy()
    state, _ = started(p)
    state, _ = decide(state, suspect(state, node="n5", standby=True, process_exited=True,
                                     slurmd_reachable=True), 1.0, p)
    assert state.standbys == {} and "n5" not in state.excluded
    state, acts = decide(state, lost(state, 1), 2.0, p)
    assert state.recovery.level == "scale-in" and "n5" not in of(acts, m.Publish)[0].plan.table.nodes


# ---------------------------------------------------------------- several ranks per node (G = 2)

def started_g2(p=None, spares=SPARES):
    p = p or policy()
    state = dataclasses.replace(fresh(spares=spares), tasks_per_node=2)
    state, acts = decide(state, m.Start(), 0.0, p)
    return ready(state, p), acts


def test_g2_start_places_two_ranks_per_node_and_two_standbys_per_spare():
    state, acts = started_g2()
    t = state.table
    assert t.world_size == 6 and t.node_list == WORKERS and t.tasks_per_node == 2
    assert [(s.node, s.local_rank) for s in t.slots[:4]] == [("n2", 0), ("n2", 1), ("n3", 0), ("n3", 1)]
    assert len(state.standbys["n5"]) == 2 and len(of(acts, m.Launch)) == 8


def test_g2_node_loss_moves_both_ranks_to_the_spare_in_one_incident():
    p = policy()
    state, _ = started_g2(p)
    warm = state.standbys["n5"]
    survivors = [s.worker_id for s in state.table.slots if s.node != "n3"]
    state, acts = decide(state, lost(state, 2), 1.0, p)  # rank 2 is n3's local rank 0
    plan = of(acts, m.Publish)[0].plan
    assert [(s.rank, s.node, s.local_rank, s.worker_id) for s in plan.table.slots[2:4]] == \
        [(2, "n5", 0, warm[0]), (3, "n5", 1, warm[1])]
    assert [s.worker_id for s in plan.table.slots if s.node != "n5"] == survivors  # survivors keep ranks
    assert plan.joining == (2, 3) and not of(acts, m.Launch) and state.recovery.level == "node-replacement"
    # the node's other rank, seen a moment later, is not a second incident
    old_n3 = [w for w in state.workers.values() if w.node == "n3" and w.role is Role.RANK]
    assert len(old_n3) == 2 and all(w.dead for w in old_n3)
    state2, acts2 = decide(state, m.Suspects((m.Suspect(worker_id=old_n3[-1].worker_id, t=1.1,
                                                        process_exited=True),)), 1.1, p)
    assert acts2 == [] and state2.recovery.number == state.recovery.number


def test_g2_one_local_rank_killed_restarts_only_that_rank():
    p = policy()
    state, _ = started_g2(p)
    before = [s.worker_id for s in state.table.slots]
    state, acts = decide(state, killed(state, 3), 1.0, p)
    plan = of(acts, m.Publish)[0].plan
    after = [s.worker_id for s in plan.table.slots]
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [3]
    assert plan.table.slots[3].node == "n3" and plan.table.slots[3].local_rank == 1
    assert [a.node for a in of(acts, m.Launch)] == ["n3"] and not of(acts, m.Isolate)


def test_g2_scale_in_drops_a_whole_node():
    p = policy()
    state, _ = started_g2(p, spares=())
    state, acts = decide(state, lost(state, 3), 1.0, p)
    t = of(acts, m.Publish)[0].plan.table
    assert t.world_size == 4 and t.node_list == ("n2", "n4") and [s.local_rank for s in t.slots] == [0, 1, 0, 1]


def test_g2_min_world_counts_ranks_not_nodes():
    p = policy(min_world_size=5, max_requeues=0)
    state, _ = started_g2(p, spares=())
    _, acts = decide(state, lost(state, 0), 1.0, p)  # 6 - 2 = 4 < 5
    assert acts[-1].code == EXIT_FAILED and "below min_world_size=5" in acts[-1].error


def test_g2_a_dead_standby_takes_its_spare_node_out_of_the_pool():
    p = policy()
    state, _ = started_g2(p)
    other = state.standbys["n5"][1]
    state, acts = decide(state, suspect(state, node="n5", standby=True, process_exited=True,
                                        slurmd_reachable=True), 1.0, p)
    assert state.standbys == {} and m.Kill(other) in acts


def test_g2_relaunch_node_loss_keeps_two_tasks_per_node():
    p = policy(Mode.RELAUNCH)
    state, _ = started_g2(p)
    state, acts = decide(state, rfaults(state, node_lost("n3")), 1.0, p)
    table = of(acts, m.Relaunch)[0].table
    assert table.node_list == ("n2", "n4", "n5") and table.tasks_per_node == 2
    assert [(s.rank, s.node, s.local_rank) for s in table.slots[2:]] == [(2, "n4", 0), (3, "n4", 1), (4, "n5", 0),
                                                                        (5, "n5", 1)]


# ---------------------------------------------------------------- healthy spares only

def test_spares_are_checked_when_their_standbys_start_and_adopted_only_after_a_pass():
    p = policy()
    state, acts = decide(fresh(spares=("n5", "n6")), m.Start(), 0.0, p)
    assert of(acts, m.CheckSpare) == [m.CheckSpare("n5"), m.CheckSpare("n6")]
    for w in state.standbys["n5"] + state.standbys["n6"]:
        state, _ = decide(state, m.Connected(w, 1, 0.1), 0.1, p)
    state, _ = decide(state, m.SpareChecked("n6", None, 0.2), 0.2, p)
    assert state.free_spares(Mode.ONLINE) == ["n6"]  # n5 not checked yet
    state, acts = decide(state, lost(state, 1), 1.0, p)
    assert of(acts, m.Publish)[0].plan.table.slots[1].node == "n6"


def test_a_spare_that_fails_its_check_is_drained_with_the_reason_and_the_next_is_taken():
    p = policy()
    state, _ = decide(fresh(spares=("n5", "n6")), m.Start(), 0.0, p)
    for w in state.standbys["n5"] + state.standbys["n6"]:
        state, _ = decide(state, m.Connected(w, 1, 0.1), 0.1, p)
    bad = state.standbys["n5"]
    state, acts = decide(state, m.SpareChecked("n5", "health_check probe exited 1: gpu 3 sick", 0.2), 0.2, p)
    assert m.Isolate("n5", "DRAIN", "slurm_resilience job 7: health check: health_check probe exited 1: gpu 3 sick") \
        in acts
    assert EventKind.SPARE_CHECK_FAILED in kinds(acts) and [a.worker_id for a in of(acts, m.Kill)] == list(bad)
    assert "n5" not in state.standbys and "n5" in state.excluded
    state, _ = decide(state, m.SpareChecked("n6", None, 0.3), 0.3, p)
    state, acts = decide(state, lost(state, 0), 1.0, p)
    assert of(acts, m.Publish)[0].plan.table.slots[0].node == "n6"


def test_a_stale_spare_is_rechecked_on_tick_and_in_parallel_at_adoption():
    p = policy(spare_check_max_age_s=10)
    state, _ = started(p)
    state, acts = decide(state, m.Tick(), 5.0, p)
    assert not of(acts, m.CheckSpare)
    state, acts = decide(state, m.Tick(), 11.0, p)
    assert of(acts, m.CheckSpare) == [m.CheckSpare("n5")] and "n5" in state.checking
    state, acts = decide(state, m.Tick(), 12.0, p)
    assert not of(acts, m.CheckSpare)  # one at a time
    state, _ = decide(state, m.SpareChecked("n5", None, 12.5), 12.5, p)
    # old again when a node is lost: adopted at once, checked in parallel (no wait)
    state, acts = decide(state, lost(state, 1), 30.0, p)
    assert of(acts, m.Publish) and of(acts, m.CheckSpare) == [m.CheckSpare("n5")]
    assert acts.index(of(acts, m.Publish)[0]) < acts.index(m.CheckSpare("n5"))
    # the re-check fails after the adoption: the node's ranks move on (here: scale-in)
    state, _ = decide(state, m.Published(1, 30.0), 30.0, p)
    state, acts = decide(state, m.SpareChecked("n5", "disk full", 30.2), 30.2, p)
    assert of(acts, m.Publish)[0].plan.table.nodes == ("n2", "n4") and of(acts, m.Isolate)[0].state == "DRAIN"


def test_a_batch_of_marks_decides_as_the_same_marks_one_by_one():
    """One poll's marks come as one ``WorkerMarks`` (O(N) per recovery, not O(N²)): the
    state and actions equal those of the marks decided one at a time, a generation's
    stray marks included, and marks after the recovery closed still count (the refill)."""
    p = policy(local_standbys=True)
    state, _ = started(p)
    state, _ = decide(state, killed(state, 1), 1.1, p)
    state, _ = decide(state, m.Published(1, 1.2), 1.2, p)
    g = state.table.generation
    marks = [m.WorkerMark(WorkerEvent.RECONNECTED, 0, g - 1, 2.0)]  # an old generation's: ignored
    marks += [m.WorkerMark(kind, rank, g, 2.5 + rank / 10) for kind in (WorkerEvent.RECONNECTED,
              WorkerEvent.RESTORED, WorkerEvent.FIRST_STEP) for rank in range(state.table.world_size)]
    marks += [m.WorkerMark(WorkerEvent.FIRST_STEP, 0, g, 2.9)]  # after the close: the job trains
    one, acts_one = state, []
    for mark in marks:
        one, acts = decide(one, mark, 3.0, p)
        acts_one += acts
    batch, acts_batch = decide(state, m.WorkerMarks(tuple(marks)), 3.0, p)
    assert batch == one and acts_batch == acts_one
    assert batch.recovery is None and EventKind.RECOVERY_DONE in kinds(acts_batch)
    half = len(marks) // 2  # split over two polls: the same again
    two, acts_two = decide(state, m.WorkerMarks(tuple(marks[:half])), 3.0, p)
    two, more = decide(two, m.WorkerMarks(tuple(marks[half:])), 3.0, p)
    assert two == one and acts_two + more == acts_one
