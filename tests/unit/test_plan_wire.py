"""The plan's compact rank table (model.RankTable.to_wire/from_wire): what every rank reads."""

import json

import pytest

from slurm_resilience.model import RankSlot, RankTable, RankTableError
from slurm_resilience.protocol import Plan, PlanAction
from slurm_resilience.supervisor.decide.ranktable import initial_table


def _table(nodes=4, g=2, device="cpu"):
    names = [f"n{i}" for i in range(nodes)]
    wids = [f"{n}.{k + 7}" for n in names for k in range(g)]
    return initial_table(names, wids, {n: f"127.0.0.{i + 1}" for i, n in enumerate(names)}, device, g)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_round_trip_through_the_plan(device):
    t = _table(device=device)
    plan = Plan(generation=3, action=list(PlanAction)[0], table=t, joining=(2, 3), reason="node_lost")
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.table.slots == t.slots


def test_foreign_ids_and_devices_travel_whole():
    t = _table()
    slots = list(t.slots)
    slots[1] = RankSlot(rank=1, node="n0", worker_id="n5.3", local_rank=1, device="cpu", address=slots[1].address)
    slots[2] = RankSlot(rank=2, node="n1", worker_id="custom-id", local_rank=0, device="cuda:3",
                        address=slots[2].address)
    t2 = RankTable(generation=1, slots=tuple(slots))  # a spare's standby id, an odd device
    wire = t2.to_wire()
    assert wire["workers"][0] == 7 and wire["workers"][1] == "n5.3" and wire["devices"] is not None
    assert RankTable.from_wire(json.loads(json.dumps(wire))) == t2


def test_much_smaller_than_the_file_form():
    t = _table(nodes=256, g=8)
    assert len(json.dumps(t.to_wire())) * 10 < len(json.dumps(t.to_dict()))


def test_the_file_form_is_still_read():
    t = _table()
    doc = json.loads(Plan(generation=1, action=list(PlanAction)[0], table=t).to_json())
    doc["table"] = t.to_dict()  # a plan written by an older supervisor (re-attach)
    assert Plan.from_json(json.dumps(doc)).table == t


@pytest.mark.parametrize("mutate", [
    lambda w: w.update(workers=w["workers"][:-1]),
    lambda w: w.update(g=0),
    lambda w: w.update(nodes=None),
    lambda w: w.update(version=99),
    lambda w: w.update(addresses=["x"]),
])
def test_malformed_wire_tables_are_one_line_errors(mutate):
    wire = _table().to_wire()
    mutate(wire)
    with pytest.raises(RankTableError) as err:
        RankTable.from_wire(wire)
    assert "\n" not in str(err.value)
