import dataclasses
import json
import os
import stat

import pytest
from hypothesis import given, settings, strategies as st

from slurm_resilience.errors import RankTableError
from slurm_resilience.supervisor.adapters.publish import write_table
from slurm_resilience.supervisor.decide.ranktable import Replacement, initial_table, regenerate

ADDR = {f"n{i}": f"10.0.0.{i}" for i in range(40)}


def _t(n=4):
    return initial_table([f"n{i}" for i in range(n)], [f"w{i}" for i in range(n)], ADDR, device="cuda")


def test_initial_table():
    t = _t(3)
    assert t.generation == 0 and t.nodes == ("n0", "n1", "n2")
    assert [s.worker_id for s in t.slots] == ["w0", "w1", "w2"]
    assert t.slots[2].address == "10.0.0.2" and t.slots[0].device == "cuda:0"


def test_initial_table_errors():
    with pytest.raises(RankTableError):
        initial_table(["n0"], ["a", "b"], ADDR)
    with pytest.raises(RankTableError):
        initial_table(["zz"], ["a"], ADDR)
    with pytest.raises(RankTableError):
        initial_table(["n0", "n0"], ["a", "b"], ADDR)


def test_regenerate_replaces_and_restarts_in_place():
    t = _t(4)
    new = regenerate(t, [Replacement(rank=1, old_node="n1", new_node="n9", new_worker_id="x"),
                         Replacement(rank=3, old_node="n3", new_node="n3", new_worker_id="y")], ADDR)
    assert new.generation == 1
    assert new.nodes == ("n0", "n9", "n2", "n3")
    assert new.slots[1].address == "10.0.0.9" and new.slots[1].worker_id == "x"
    assert new.slots[3].worker_id == "y"
    assert new.slots[0] == t.slots[0] and new.slots[2] == t.slots[2]
    assert new.slots[1].device == "cuda:0"


@pytest.mark.parametrize(
    "reps",
    [
        [Replacement(rank=1, old_node="n2", new_node="n9", new_worker_id="x")],  # wrong old node
        [Replacement(rank=1, old_node="n1", new_node="n2", new_worker_id="x")],  # new node in table
        [Replacement(rank=7, old_node="n1", new_node="n9", new_worker_id="x")],  # out of range
        [Replacement(rank=1, old_node="n1", new_node="n9", new_worker_id="x"),
         Replacement(rank=1, old_node="n1", new_node="n8", new_worker_id="y")],  # same rank
        [Replacement(rank=1, old_node="n1", new_node="n9", new_worker_id="x"),
         Replacement(rank=2, old_node="n2", new_node="n9", new_worker_id="y")],  # same new node
        [Replacement(rank=1, old_node="n1", new_node="n2", new_worker_id="x"),
         Replacement(rank=2, old_node="n2", new_node="n1", new_worker_id="y")],  # swap
        [Replacement(rank=1, old_node="n1", new_node="n1", new_worker_id="w1")],  # restart, same id
        [Replacement(rank=1, old_node="n1", new_node="unknown", new_worker_id="x")],  # no address
    ],
)
def test_regenerate_errors(reps):
    with pytest.raises(RankTableError):
        regenerate(_t(4), reps, {**ADDR})


@st.composite
def scenario(draw):
    n = draw(st.integers(1, 8))
    table = _t(n)
    steps = []
    free = [f"n{i}" for i in range(n, 40)]
    for g in range(draw(st.integers(1, 5))):
        ranks = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        reps = []
        for r in ranks:
            in_place = draw(st.booleans())
            reps.append((r, in_place))
        steps.append(reps)
    return table, steps, free


@settings(max_examples=150, deadline=None)
@given(scenario())
def test_regenerate_invariants(sc):
    table, steps, free = sc
    counter = 0
    for reps in steps:
        replacements = []
        for r, in_place in reps:
            counter += 1
            old = table.slots[r].node
            new = old if in_place else free.pop(0)
            replacements.append(Replacement(rank=r, old_node=old, new_node=new, new_worker_id=f"g{counter}"))
        new_table = regenerate(table, replacements, ADDR)
        replaced = {rep.rank for rep in replacements}
        assert new_table.generation == table.generation + 1
        assert new_table.world_size == table.world_size
        assert [s.rank for s in new_table.slots] == list(range(table.world_size))
        assert len(set(new_table.nodes)) == new_table.world_size
        for old_s, new_s in zip(table.slots, new_table.slots):
            if old_s.rank in replaced:
                assert new_s.worker_id != old_s.worker_id
                assert new_s.address == ADDR[new_s.node]
            else:
                assert new_s == old_s
        table = new_table


def test_write_table(tmp_path):
    t = _t(2)
    d = str(tmp_path / "rt")
    p0 = write_table(t, d)
    t1 = regenerate(t, [Replacement(rank=0, old_node="n0", new_node="n5", new_worker_id="z")], ADDR)
    p1 = write_table(t1, d)
    assert os.path.basename(p0) == "ranktable-gen0000.json" and os.path.basename(p1) == "ranktable-gen0001.json"
    assert json.loads(open(p0).read())["generation"] == 0
    latest = os.path.join(d, "ranktable.json")
    assert open(latest).read() == t1.to_json()
    assert stat.S_IMODE(os.stat(p1).st_mode) == 0o600
    assert sorted(os.listdir(d)) == ["ranktable-gen0000.json", "ranktable-gen0001.json", "ranktable.json"]


# ---------------------------------------------------------------- several ranks per node

@st.composite
def node_scenario(draw):
    g = draw(st.integers(1, 4))
    n = draw(st.integers(1, 6))
    workers = [f"n{i}" for i in range(n)]
    table = initial_table(workers, [f"w{i}" for i in range(n * g)], ADDR, device="cuda", tasks_per_node=g)
    events = draw(st.lists(st.tuples(st.sampled_from(["lose", "restart", "shrink"]), st.integers(0, 10**6)),
                           max_size=6))
    return table, events


@settings(max_examples=200, deadline=None)
@given(node_scenario())
def test_node_moves_restarts_and_shrinks_keep_the_node_invariants(sc):
    """Every slot filled once, survivors keep their rank and worker, a node's G ranks stay
    together with local ranks 0..G-1, no node holds ranks of two node slots."""
    from slurm_resilience.supervisor.decide.ranktable import shrink

    table, events = sc
    g = table.tasks_per_node
    free = [f"n{i}" for i in range(20, 40)]
    counter = 0
    for kind, pick in events:
        node = table.node_list[pick % len(table.node_list)]
        ranks = table.ranks_on(node)
        if kind == "lose" and free:
            spare = free.pop(0)
            reps = []
            for r in ranks:
                counter += 1
                reps.append(Replacement(rank=r, old_node=node, new_node=spare, new_worker_id=f"s{counter}"))
            new = regenerate(table, reps, ADDR)
            assert new.ranks_on(spare) == ranks and not new.ranks_on(node)
        elif kind == "restart":
            r = ranks[pick % g]
            counter += 1
            new = regenerate(table, [Replacement(rank=r, old_node=node, new_node=node, new_worker_id=f"s{counter}")],
                             ADDR)
            assert [s.worker_id != o.worker_id for s, o in zip(new.slots, table.slots)].count(True) == 1
        elif kind == "shrink" and len(table.node_list) > 1:
            new = shrink(table, ranks)
            assert new.world_size == table.world_size - g and node not in new.node_list
            kept = [s.worker_id for s in table.slots if s.node != node]
            assert [s.worker_id for s in new.slots] == kept
        else:
            continue
        assert [s.rank for s in new.slots] == list(range(new.world_size))
        assert new.tasks_per_node == g and all(s.device == f"cuda:{s.local_rank}" for s in new.slots)
        assert all(new.group_rank(s.rank) == new.node_list.index(s.node) for s in new.slots)
        table = new


def test_a_node_must_move_whole():
    t = initial_table(["n0", "n1"], ["a", "b", "c", "d"], ADDR, tasks_per_node=2)
    with pytest.raises(RankTableError):  # only local rank 1 of n1 moves: n9 would start at local rank 1
        regenerate(t, [Replacement(rank=3, old_node="n1", new_node="n9", new_worker_id="x")], ADDR)
    from slurm_resilience.supervisor.decide.ranktable import shrink

    with pytest.raises(RankTableError):
        shrink(t, [2])  # half a node


def test_publish_sets_and_tells_the_plan_before_the_table_files_are_written(tmp_path):
    """The files are for people: the plan goes to the store and the pulses first, and each
    node's pulse is told once (not once per rank: G copies of the plan each)."""
    from slurm_resilience.protocol import Plan, PlanAction, StoreKey
    from slurm_resilience.supervisor.adapters.publish import LATEST_NAME, publish_plan

    d, order = tmp_path / "tables", []
    table = initial_table(["n0", "n1"], ["n0.1", "n0.2", "n1.3", "n1.4"], ADDR, tasks_per_node=2)
    plan = Plan(generation=3, action=PlanAction.RUN, table=dataclasses.replace(table, generation=3), joining=(),
                reason="test")

    class Store:
        def set(self, key, value):
            order.append(("set", key, (d / LATEST_NAME).exists()))

    def tell(notice, nodes):
        order.append(("tell", notice["plan"], (d / LATEST_NAME).exists(), list(nodes)))

    path, out = publish_plan(Store(), plan, str(d), tell=tell)
    assert order == [("set", StoreKey.PLAN.of(3), False), ("tell", 3, False, ["n0", "n1"])]
    assert json.loads((d / LATEST_NAME).read_text())["generation"] == 3 and path.endswith("gen0003.json")
    assert out <= os.stat(path).st_mtime + 0.01  # out before the files (the ranktable phase ends there)


def test_the_table_file_has_a_rank_per_line_and_reads_back_whatever_the_ids_hold():
    """The people's form (C encoder, a line break between ranks) parses to the same table;
    an id that holds the separator itself falls back to the indented form."""
    from slurm_resilience.model import RankSlot, RankTable

    t = _t(3)
    text = t.to_json()
    lines = text.splitlines()
    assert RankTable.from_json(text) == t and json.loads(text) == t.to_dict()
    assert [ln for ln in lines if ln.lstrip().startswith('{"')] == lines[-5:-2]  # three ranks, one line each
    odd = RankTable(0, (RankSlot(rank=0, node="n0", worker_id='w}, {"x'),))
    assert RankTable.from_json(odd.to_json()) == odd
    assert RankTable.from_json(RankTable(0, ()).to_json()) == RankTable(0, ())
