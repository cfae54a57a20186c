"""recovery.local_standbys (supervisor/decide/standbys.py): one warm standby per worker node takes
the slot of a rank restarted in place; pure decisions only (no Slurm, torch or files).
K standbys per node (``local_standbys_per_node``) and a spare's extra ones:
tests/unit/test_local_standbys_count.py."""

import dataclasses
import json

from slurm_resilience.config import load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.lifecycle import JobPhase
from slurm_resilience.model import RankTable
from slurm_resilience.protocol import EventKind, Role, WorkerEvent
from slurm_resilience.supervisor.decide import standbys
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.decide import decide
from slurm_resilience.supervisor.executors.reattach import adopt_plans
from slurm_resilience.supervisor.adapters.status import StatusMode, status_dict
from slurm_resilience.supervisor.decide.state import Mode, Policy, SupervisorState

import pytest

WORKERS, SPARES = ("n2", "n3", "n4"), ("n5",)


def policy(mode=Mode.ONLINE, **recovery):
    cfg = load_config({"recovery": {"online_timeout_s": 10, "fallback_timeout_s": 20, **recovery}})
    return Policy.from_config(cfg, mode=mode, can_requeue=True)


def started(p=None, g=1, connect=True):
    p = p or policy()
    state = SupervisorState(job_id="7", phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
                            target_world=len(WORKERS), worker_nodes=WORKERS, spare_nodes=SPARES,
                            addresses={n: f"10.0.0.{n[1:]}" for n in WORKERS + SPARES}, tasks_per_node=g)
    state, acts = decide(state, m.Start(), 0.0, p)
    state, more = decide(state, m.WorkerMark(WorkerEvent.FIRST_STEP, 0, 0, 0.05), 0.05, p)  # the job trains
    acts = acts + more
    for wid, w in list(state.workers.items()):
        if w.role is Role.STANDBY and (connect or w.node in SPARES):
            state, _ = decide(state, m.Connected(wid, 100, 0.1), 0.1, p)
    state, _ = decide(state, m.SpareChecked("n5", None, 0.2), 0.2, p)
    return state, acts


def of(acts, cls):
    return [a for a in acts if isinstance(a, cls)]


def kinds(acts):
    return [a.kind for a in of(acts, m.Emit)]


def one(state, node):
    """``node``'s one standby (K = 1, the default), None when it has none."""
    pool = state.local_standbys.get(node, ())
    assert len(pool) <= 1
    return pool[0] if pool else None


def killed(state, rank):  # a process died on a healthy node
    wid = state.table.slots[rank].worker_id
    return m.Suspects((m.Suspect(worker_id=wid, t=1.0, process_exited=True, slurmd_reachable=True),))


def finish(state, p, now=3.0):
    acts_all = []
    for rank in range(state.table.world_size):
        for kind in (WorkerEvent.RECONNECTED, WorkerEvent.RESTORED, WorkerEvent.FIRST_STEP):
            state, acts = decide(state, m.WorkerMark(kind, rank, state.table.generation, 2.5), now, p)
            acts_all += acts
    return state, acts_all


def test_the_key_defaults_on_and_is_online_only():
    assert load_config({}).recovery.local_standbys is True
    assert policy().local_standbys and not policy(local_standbys=False).local_standbys
    assert not policy(mode=Mode.RELAUNCH).local_standbys  # relaunch mode: the zygotes (run.warm)
    with pytest.raises(ConfigError):
        load_config({"recovery": {"local_standbys": "sometimes"}})


def test_the_worker_nodes_standbys_start_with_the_jobs_first_step_not_with_its_ranks():
    p = policy()
    state = SupervisorState(job_id="7", phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
                            target_world=len(WORKERS), worker_nodes=WORKERS, spare_nodes=SPARES,
                            addresses={n: f"10.0.0.{n[1:]}" for n in WORKERS + SPARES})
    state, acts = decide(state, m.Start(), 0.0, p)
    # the ranks and the spare's standby only: 3 more imports would slow the ranks' start
    assert [a.node for a in of(acts, m.Launch) if a.role is Role.STANDBY] == ["n5"]
    assert not state.local_standbys and EventKind.LOCAL_STANDBY_STARTED not in kinds(acts)
    state, acts = decide(state, m.WorkerMark(WorkerEvent.RECONNECTED, 0, 0, 0.04), 0.04, p)
    assert not of(acts, m.Launch)
    state, acts = decide(state, m.WorkerMark(WorkerEvent.FIRST_STEP, 2, 0, 0.05), 0.05, p)
    assert sorted(a.node for a in of(acts, m.Launch)) == [*WORKERS, *SPARES]  # and the spare's extra one
    state, acts = decide(state, m.WorkerMark(WorkerEvent.FIRST_STEP, 1, 0, 0.06), 0.06, p)
    assert not of(acts, m.Launch)  # one each
    off = policy(local_standbys=False)
    state, _ = decide(dataclasses.replace(state, local_standbys={}), m.WorkerMark(WorkerEvent.FIRST_STEP, 0, 0, 0.1),
                      0.1, off)
    assert not state.local_standbys


def test_start_launches_one_standby_per_worker_node_whatever_g():
    for g in (1, 2):
        state, acts = started(g=g)
        standbys = [(a.node, a.role) for a in of(acts, m.Launch) if a.role is Role.STANDBY]
        # the spare's G, then one per worker node and one extra on the spare
        assert standbys == [("n5", Role.STANDBY)] * g + [(n, Role.STANDBY) for n in WORKERS + SPARES]
        assert sorted(state.local_standbys) == list(WORKERS + SPARES)
        assert kinds(acts).count(EventKind.LOCAL_STANDBY_STARTED) == 4
        assert all(state.watched(one(state, n)) and state.slot_of(one(state, n)) is None for n in state.local_standbys)
        assert state.free_spares(Mode.ONLINE) == ["n5"]  # not spares: they never take a whole node
        assert one(state, "n5") not in state.standbys["n5"]


def test_a_requeued_start_launches_the_node_standbys_after_its_first_step_once():
    """A requeued (or resubmitted) job's restart follows the first start's rule: its ranks'
    start is the critical path, so the nodes' own standbys start after the first rank's
    first step (the spare's G standbys still start with the ranks)."""
    p = policy()
    fresh = SupervisorState(job_id="7", phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
                            target_world=len(WORKERS), worker_nodes=WORKERS, spare_nodes=SPARES,
                            addresses={n: f"10.0.0.{n[1:]}" for n in WORKERS + SPARES}, requeue_count=1)
    state, acts = decide(fresh, m.Start(), 0.0, p)
    assert [(a.node, a.role) for a in of(acts, m.Launch) if a.role is Role.STANDBY] == [("n5", Role.STANDBY)]
    assert state.local_standbys == {}
    state, acts = decide(state, m.WorkerMark(WorkerEvent.RECONNECTED, 0, 0, 1.0), 1.0, p)
    assert of(acts, m.Launch) == []  # joined is not enough: the first step ends the critical path
    state, acts = decide(state, m.WorkerMark(WorkerEvent.FIRST_STEP, 1, 0, 2.0), 2.0, p)
    assert [(a.node, a.role, a.generation) for a in of(acts, m.Launch)] == \
        [(n, Role.STANDBY, 0) for n in (*WORKERS, *SPARES)]  # the spare's extra one too
    assert sorted(state.local_standbys) == [*WORKERS, *SPARES]
    assert kinds(acts).count(EventKind.LOCAL_STANDBY_STARTED) == 4
    for rank in (0, 2):  # the other ranks' first steps launch nothing more
        state, acts = decide(state, m.WorkerMark(WorkerEvent.FIRST_STEP, rank, 0, 2.1), 2.1, p)
        assert of(acts, m.Launch) == []


def test_a_rank_killed_on_a_healthy_node_goes_to_its_node_standby_without_a_process_start():
    p = policy()
    state, _ = started(p)
    warm = one(state, "n3")
    state, acts = decide(state, killed(state, 1), 1.1, p)
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.slots[1].node == "n3" and plan.table.slots[1].worker_id == warm and plan.joining == (1,)
    assert not of(acts, m.Launch) and state.recovery.level == "online"
    assert "n3" not in state.local_standbys and state.fault_retries_used == 1
    adopted = [a.fields for a in of(acts, m.Emit) if a.kind is EventKind.LOCAL_STANDBY_ADOPTED]
    assert adopted == [{"rank": 1, "node": "n3", "worker_id": warm, "generation": 1}]
    # the refill waits until the recovery is done (its import would compete for the CPU)
    state, acts = decide(state, m.Published(1, 1.2), 1.2, p)
    assert not of(acts, m.Launch)
    state, acts = finish(state, p)
    assert [(a.node, a.role, a.generation) for a in of(acts, m.Launch)] == [("n3", Role.STANDBY, 1)]
    assert one(state, "n3") not in (warm, None) and state.phase is JobPhase.RUNNING
    assert kinds(acts).index(EventKind.RECOVERY_DONE) < kinds(acts).index(EventKind.LOCAL_STANDBY_STARTED)


def test_g2_one_standby_serves_either_local_slot_and_a_second_death_runs_cold():
    p = policy()
    state, _ = started(p, g=2)
    warm = one(state, "n3")
    state, acts = decide(state, killed(state, 3), 1.0, p)  # n3's local rank 1
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.slots[3].worker_id == warm and plan.table.slots[3].local_rank == 1
    # both ranks of n3 die together: one takes the standby, the other a new process
    state, _ = started(p, g=2)
    ids = [state.table.slots[r].worker_id for r in (2, 3)]
    both = m.Suspects(tuple(m.Suspect(worker_id=w, t=1.0, process_exited=True, slurmd_reachable=True) for w in ids))
    state, acts = decide(state, both, 1.0, p)
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.slots[2].worker_id == warm and plan.table.slots[3].worker_id not in ids + [warm]
    assert [(a.node, a.role) for a in of(acts, m.Launch)] == [("n3", Role.RANK)]


@pytest.mark.parametrize("why", ["off", "not connected", "dead"])
def test_without_a_usable_standby_the_restart_in_place_launches_as_before(why):
    p = policy(local_standbys=why != "off")
    state, acts = started(p, connect=why != "not connected")
    if why == "dead":
        state, _ = decide(state, m.Suspects((m.Suspect(worker_id=one(state, "n3"), t=0.5,
                                                       process_exited=True, slurmd_reachable=True),)), 0.5, p)
        assert "n3" not in state.local_standbys and state.recovery is None  # an idle standby: no recovery
    if why == "off":
        assert state.local_standbys == {} and [a.role for a in of(acts, m.Launch)].count(Role.STANDBY) == 1
    state, acts = decide(state, killed(state, 1), 1.0, p)
    assert [(a.node, a.role, a.generation) for a in of(acts, m.Launch)] == [("n3", Role.RANK, 1)]
    assert EventKind.LOCAL_STANDBY_ADOPTED not in kinds(acts)


def test_a_lost_node_takes_its_standby_with_it_and_the_spare_brings_its_own():
    p = policy()
    state, _ = started(p)
    warm, extra = one(state, "n3"), one(state, "n5")
    wid = state.table.slots[1].worker_id
    state, acts = decide(state, m.Suspects((m.Suspect(worker_id=wid, t=1.0, process_exited=True,
                                                      slurmd_reachable=False),)), 1.0, p)
    assert state.recovery.level == "node-replacement" and "n3" not in state.local_standbys
    assert state.workers[warm].dead and m.Kill(warm) not in acts  # nothing waits on the lost node
    state, _ = decide(state, m.Published(1, 1.2), 1.2, p)
    state, acts = finish(state, p)
    assert not of(acts, m.Launch)  # n5 is a worker now, with the extra standby it kept as a spare
    assert "n3" not in state.local_standbys and one(state, "n5") == extra


def test_state_round_trips_reattach_drops_a_taken_standby_and_status_lists_them():
    p = policy()
    state, _ = started(p)
    back = SupervisorState.from_dict(state.to_dict())
    assert back.local_standbys == state.local_standbys
    after, acts = decide(state, killed(state, 1), 1.0, p)
    plan = of(acts, m.Publish)[0].plan
    assert "n3" not in adopt_plans(state, [plan]).local_standbys
    st = status_dict(state, mode=StatusMode.ONLINE, retry_budget=3)
    assert [(x["node"], x["worker_id"], x["pid"]) for x in st["local_standbys"]] == \
        [(n, one(state, n), 100) for n in WORKERS + SPARES]
    assert standbys.is_local(state, one(state, "n2")) and not standbys.is_local(state, plan.table.slots[0].worker_id)


def test_status_tolerates_a_slot_whose_launch_failed():
    """Regression (a8c7c72): a rank slot with no worker record (its launch failed) is
    reported with pid None and step 0, not a KeyError that stops the status writer."""
    state, _ = started(policy())
    lost = state.table.slots[1].worker_id
    state = dataclasses.replace(state, workers={k: v for k, v in state.workers.items() if k != lost})
    ranks = status_dict(state, mode=StatusMode.ONLINE, retry_budget=3)["ranks"]
    assert (ranks[1]["worker_id"], ranks[1]["pid"], ranks[1]["step"]) == (lost, None, 0)
    state, _ = decide(state, m.Connected(state.table.slots[0].worker_id, 4242, 0.3), 0.3, policy())
    assert status_dict(state, mode=StatusMode.ONLINE, retry_budget=3)["ranks"][0]["pid"] == 4242  # the others as before


def test_status_mode_is_written_as_the_same_strings():
    state, _ = started(policy())
    for mode, text in ((StatusMode.ONLINE, "online"), (StatusMode.TORCH, "torch"), (StatusMode.MPI, "mpi")):
        assert json.loads(json.dumps(status_dict(state, mode=mode, retry_budget=3)))["mode"] == text
    with pytest.raises(ValueError):
        status_dict(state, mode="relaunch", retry_budget=3)


def test_a_migrated_straggler_node_ends_its_standby():
    p = policy(migrate_stragglers=True)
    state, _ = started(p)
    warm = one(state, "n3")
    state, acts = decide(state, m.Straggler(1, 50.0, (10.0, 11.0)), 1.0, p)
    assert m.Kill(warm) in acts and "n3" not in state.local_standbys and state.workers[warm].dead
    state = dataclasses.replace(state, recovery=None)
    state, acts = standbys.refill(state, p, state.table.generation)
    assert not of(acts, m.Launch)  # n3 is excluded; n5 brought its extra standby


def test_a_frozen_node_is_silent_though_its_standby_is_not_stale_yet():
    """The standby's heartbeat is judged on the longer standby time-out: the node's ranks
    alone decide that it is silent (else a frozen node would be restarted in place)."""
    from test_silent_node import Launcher, _released, _watch
    p = policy()
    state, _ = started(p)
    w = _watch(Launcher(False))
    frozen = state.table.slots[1]
    suspects = {frozen.worker_id: {"t": 1.0, "heartbeat_stale": True}}
    w._hold_silent(state, suspects)
    assert suspects == {} and frozen.node in w._held
    state, acts = decide(state, _released(w, state), 2.0, p)
    assert state.recovery.level == "node-replacement" and not of(acts, m.Launch)
    assert "n3" not in state.local_standbys


def test_a_standby_alone_seen_on_a_lost_node_does_not_isolate_its_ranks_node():
    """Only the node's ranks decide a node fault (an isolated node's ranks would be stranded)."""
    p = policy()
    state, _ = started(p)
    warm = one(state, "n3")
    state, acts = decide(state, m.Suspects((m.Suspect(worker_id=warm, t=1.0, process_exited=True,
                                                      slurmd_reachable=False),)), 1.0, p)
    assert not of(acts, m.Isolate) and "n3" not in state.excluded and state.recovery is None
    assert "n3" not in state.local_standbys and state.workers[warm].dead


def test_a_standby_preloads_run_preload_and_a_bad_module_is_a_warning(caplog):
    import sys
    from slurm_resilience.worker.session import preload
    sys.modules.pop("colorsys", None)
    assert preload(["colorsys", "no_such_module_sr"]) == ["no_such_module_sr"]
    assert "colorsys" in sys.modules and "no_such_module_sr" in caplog.text


def timed_out(state, p, fault):
    """``fault`` recovered online, which then trains no step before its time-out."""
    state, _ = decide(state, fault, 1.0, p)
    state, _ = decide(state, m.Published(state.table.generation, 1.1), 1.1, p)
    return decide(state, m.Tick(), 20.0, p)


def test_the_process_restart_adopts_each_nodes_standby_for_its_first_slot():
    """The relaunch of every rank (the survivors may be hung: all are ended) gives each
    node's idle standby that node's first slot; the other slots start cold."""
    for g in (1, 2):
        p = policy()
        state, _ = started(p, g=g)
        warm = {n: one(state, n) for n in WORKERS}
        state, acts = timed_out(state, p, killed(state, 1))  # rank 1 (n2 or n3) took its node's standby
        node1 = "n2" if g == 2 else "n3"
        assert state.recovery.level == "process-restart" and EventKind.FALLBACK in kinds(acts)
        plan = of(acts, m.Publish)[0].plan
        assert plan.joining == tuple(range(3 * g))
        first = {n: plan.table.ranks_on(n)[0] for n in WORKERS}
        adopted = [a.fields for a in of(acts, m.Emit) if a.kind is EventKind.LOCAL_STANDBY_ADOPTED]
        assert adopted == [{"rank": first[n], "node": n, "worker_id": warm[n], "generation": 2}
                           for n in WORKERS if n != node1]
        assert all(plan.table.slots[first[n]].worker_id == warm[n] for n in WORKERS if n != node1)
        cold = [(a.node, a.role, a.generation) for a in of(acts, m.Launch)]
        assert sorted(cold) == [(n, Role.RANK, 2) for n in (["n3"] if g == 1 else ["n2", "n2", "n3", "n4"])]
        idle = {warm[n] for n in WORKERS if n != node1}  # warm[node1] is rank 1 now: a survivor
        assert warm[node1] in {a.worker_id for a in of(acts, m.Kill)}
        assert not {a.worker_id for a in of(acts, m.Kill)} & idle  # idle standbys are not survivors
        assert list(state.local_standbys) == ["n5"]  # the spare's extra one: n5 is not in the table
        state, _ = decide(state, m.Published(2, 20.1), 20.1, p)
        state, acts = finish(state, p, now=21.0)
        assert sorted((a.node, a.role) for a in of(acts, m.Launch)) == [(n, Role.STANDBY) for n in WORKERS]


@pytest.mark.parametrize("why", ["off", "not connected", "excluded"])
def test_the_process_restart_runs_cold_without_a_usable_standby(why):
    p = policy(local_standbys=why != "off")
    state, _ = started(p, connect=why != "not connected")
    if why == "excluded":  # e.g. a node found faulty meanwhile: its standby is not trusted
        state = dataclasses.replace(state, excluded=state.excluded | {"n2"})
    state, acts = timed_out(state, p, killed(state, 1))
    want = {"off": 3, "not connected": 3, "excluded": 2}[why]  # n3's standby took rank 1 online
    assert len(of(acts, m.Launch)) == want
    assert kinds(acts).count(EventKind.LOCAL_STANDBY_ADOPTED) == 3 - want


def test_a_lost_nodes_standby_is_never_adopted_by_the_process_restart():
    p = policy()
    state, _ = started(p)
    warm = {n: one(state, n) for n in WORKERS + SPARES}
    wid = state.table.slots[1].worker_id
    lost = m.Suspects((m.Suspect(worker_id=wid, t=1.0, process_exited=True, slurmd_reachable=False),))
    state, acts = timed_out(state, p, lost)
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.nodes == ("n2", "n5", "n4") and warm["n3"] not in {s.worker_id for s in plan.table.slots}
    assert not of(acts, m.Launch)  # every slot warm: the former spare brought its extra standby
    assert [s.worker_id for s in plan.table.slots] == [warm["n2"], warm["n5"], warm["n4"]]


def test_a_lost_node_s_rank_and_its_own_standby_seen_together_isolate_the_node_once():
    """A node's pulse closed and its slurmd refused: its rank and its own standby are
    suspects of one incident. The rank's node fault drops the standby with its node; the
    standby is not judged again, so the node is isolated once and replaced once."""
    p = policy()
    state, _ = started(p)
    rank1 = state.table.slots[1]
    sb = one(state, rank1.node)
    assert sb is not None
    obs = m.Suspects(tuple(m.Suspect(worker_id=w, t=1.0, slurmd_reachable=False) for w in (rank1.worker_id, sb)))
    state, acts = decide(state, obs, 1.0, p)
    assert [a.node for a in of(acts, m.Isolate)] == [rank1.node]
    assert kinds(acts).count(EventKind.FAULT_DETECTED) == 1
    assert state.recovery.level == "node-replacement" and rank1.node in state.excluded
