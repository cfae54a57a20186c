"""recovery.local_standbys_per_node (supervisor/decide/standbys.py): K standbys per node, and the K
extra ones every spare node keeps, so that a process restart right after a node
replacement finds every slot warm. Pure decisions only (no Slurm, torch or files)."""

import dataclasses

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.protocol import EventKind, Role
from slurm_resilience.supervisor.decide import standbys
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.decide import decide
from slurm_resilience.supervisor.executors.reattach import adopt_plans
from slurm_resilience.supervisor.decide.state import SupervisorState

from test_local_standbys import SPARES, WORKERS, finish, kinds, killed, of, policy, started, timed_out


def lost(state, rank):  # the node of ``rank`` answers nothing
    wid = state.table.slots[rank].worker_id
    return m.Suspects((m.Suspect(worker_id=wid, t=1.0, process_exited=True, slurmd_reachable=False),))


@pytest.mark.parametrize("value, want", [(None, 1), ("all", "all"), (2, 2)])
def test_the_key_defaults_to_one_and_takes_a_count_or_all(value, want):
    recovery = {} if value is None else {"local_standbys_per_node": value}
    assert load_config({"recovery": recovery}).recovery.local_standbys_per_node == want


@pytest.mark.parametrize("bad, message", [
    (0, 'recovery.local_standbys_per_node=0 must be an integer >= 1 or "all" (one per slot of the node)'),
    ("some", "recovery.local_standbys_per_node='some' must be an integer >= 1 or \"all\""),
    (True, "recovery.local_standbys_per_node must be an integer or a string, got True"),
    (1.5, "recovery.local_standbys_per_node must be an integer or a string, got 1.5"),
])
def test_a_bad_count_is_one_line_naming_the_key(bad, message):
    with pytest.raises(ConfigError) as err:
        load_config({"recovery": {"local_standbys_per_node": bad}})
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("g, value, off, want", [(1, 1, False, 1), (2, 1, False, 1), (2, "all", False, 2),
                                                 (2, 5, False, 2), (4, 3, False, 3), (2, "all", True, 0)])
def test_k_is_the_count_never_more_than_g_and_zero_when_off(g, value, off, want):
    p = policy(local_standbys=not off, local_standbys_per_node=value)
    state, _ = started(p, g=g)
    assert standbys.per_node(state, p) == want
    assert {n: len(w) for n, w in state.local_standbys.items()} == ({} if off else
                                                                    {n: want for n in WORKERS + SPARES})
    assert all(x not in state.standbys["n5"] for x in state.local_standbys.get("n5", ()))
    assert kinds(started(p, g=g)[1]).count(EventKind.LOCAL_STANDBY_STARTED) == 4 * want


def test_g2_all_the_process_restart_after_a_node_replacement_starts_no_process():
    """The node replacement (n3's two ranks onto n5's two standbys) times out: the
    process restart gives every slot an idle standby, the former spare's included."""
    p = policy(local_standbys_per_node="all")
    state, _ = started(p, g=2)
    own = dict(state.local_standbys)
    state, acts = timed_out(state, p, lost(state, 2))  # rank 2 is on n3
    plan = of(acts, m.Publish)[0].plan
    assert state.recovery.level == "process-restart" and plan.table.nodes == ("n2", "n2", "n5", "n5", "n4", "n4")
    assert not of(acts, m.Launch) and plan.joining == tuple(range(6))
    assert [s.worker_id for s in plan.table.slots] == [*own["n2"], *own["n5"], *own["n4"]]
    assert not {a.worker_id for a in of(acts, m.Kill)} & {w for n in ("n2", "n5", "n4") for w in own[n]}
    assert kinds(acts).count(EventKind.LOCAL_STANDBY_ADOPTED) == 6 and state.local_standbys == {}
    state, _ = decide(state, m.Published(2, 20.1), 20.1, p)
    state, acts = finish(state, p, now=21.0)  # refilled after the recovery: K on each node of the table
    assert sorted((a.node, a.role) for a in of(acts, m.Launch)) == [(n, Role.STANDBY) for n in
                                                                    ("n2", "n2", "n4", "n4", "n5", "n5")]


def test_k1_g2_the_process_restart_adopts_one_per_node_and_starts_the_rest():
    p = policy()
    state, _ = started(p, g=2)
    state, acts = timed_out(state, p, lost(state, 2))
    assert kinds(acts).count(EventKind.LOCAL_STANDBY_ADOPTED) == 3
    assert sorted(a.node for a in of(acts, m.Launch)) == ["n2", "n4", "n5"]


def test_one_of_k_standbys_dying_leaves_the_others_and_is_replaced_after_a_recovery():
    p = policy(local_standbys_per_node="all")
    state, _ = started(p, g=2)
    a, b = state.local_standbys["n3"]
    state, acts = decide(state, m.Suspects((m.Suspect(worker_id=a, t=0.5, process_exited=True,
                                                      slurmd_reachable=True),)), 0.5, p)
    assert state.local_standbys["n3"] == (b,) and state.workers[a].dead and state.recovery is None
    state, acts = decide(state, killed(state, 2), 1.0, p)  # n3's rank 2 restarted in place by b
    assert of(acts, m.Publish)[0].plan.table.slots[2].worker_id == b and not of(acts, m.Launch)
    state, _ = decide(state, m.Published(1, 1.2), 1.2, p)
    state, acts = finish(state, p)
    assert [(x.node, x.role) for x in of(acts, m.Launch)] == [("n3", Role.STANDBY)] * 2


def test_a_lost_spare_takes_its_extra_standbys_with_it_and_nothing_waits_on_it():
    p = policy()
    state, _ = started(p)
    extra, pool = state.local_standbys["n5"], state.standbys["n5"]
    state, acts = decide(state, m.Suspects((m.Suspect(worker_id=pool[0], t=1.0, process_exited=True,
                                                      slurmd_reachable=False),)), 1.0, p)
    assert "n5" not in state.local_standbys and all(state.workers[w].dead for w in extra)
    assert not {a.worker_id for a in of(acts, m.Kill)} & set(extra) and "n5" in state.excluded
    state, acts = standbys.refill(state, p, 0)
    assert not of(acts, m.Launch)  # an excluded node gets none


def test_a_spare_that_fails_its_check_ends_its_extra_standbys():
    p = policy()
    state, _ = started(p)
    extra = state.local_standbys["n5"]
    state, acts = decide(state, m.SpareChecked("n5", "disk full", 0.3), 0.3, p)
    assert set(extra) <= {a.worker_id for a in of(acts, m.Kill)} and "n5" not in state.local_standbys


def test_k_standbys_round_trip_and_reattach_drops_only_the_taken_one():
    p = policy(local_standbys_per_node="all")
    state, _ = started(p, g=2)
    assert SupervisorState.from_dict(state.to_dict()).local_standbys == state.local_standbys
    old = state.to_dict() | {"local_standbys": {"n2": state.local_standbys["n2"][0]}}  # the one-standby format
    assert SupervisorState.from_dict(old).local_standbys == {"n2": state.local_standbys["n2"][:1]}
    a, b = state.local_standbys["n3"]
    _, acts = decide(state, killed(state, 2), 1.0, p)
    plan = of(acts, m.Publish)[0].plan
    assert adopt_plans(state, [plan]).local_standbys["n3"] == (b,) and plan.table.slots[2].worker_id == a
    assert set(state.local_standbys) == set(WORKERS + SPARES)


def test_a_returning_node_gets_its_own_standbys_with_its_spare_pool():
    """Scale back out: the returned node's G standbys become ranks; the K of its own,
    started with them, stay its local standbys (nothing to refill for it afterwards)."""
    p = policy()
    state, _ = started(p)
    state, _ = decide(state, lost(state, 1), 1.0, p)  # n3 lost, n5 takes rank 1
    state, _ = decide(state, m.Published(1, 1.2), 1.2, p)
    state, _ = finish(state, p)
    state = dataclasses.replace(state, target_world=4)  # room for one more node
    state, acts = decide(state, m.NodeBack("n3", "IDLE"), 4.0, p)
    launched = [(a.node, a.role) for a in of(acts, m.Launch)]
    assert launched == [("n3", Role.STANDBY)] * 2 and len(state.local_standbys["n3"]) == 1
    own = state.local_standbys["n3"]
    for a in of(acts, m.Launch):
        state, _ = decide(state, m.Connected(a.worker_id, 99, 4.5), 4.5, p)
    state, acts = decide(state, m.SpareChecked("n3", None, 4.6), 4.6, p)
    plan = of(acts, m.Publish)[0].plan
    assert plan.table.slots[-1].node == "n3" and plan.table.slots[-1].worker_id not in own
    assert state.local_standbys["n3"] == own
