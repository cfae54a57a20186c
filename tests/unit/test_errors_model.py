import json

import pytest

from slurm_resilience import errors
from slurm_resilience.errors import RankTableError, SlurmCommandError
from slurm_resilience.model import Fault, FaultKind, RankSlot, RankTable


def test_every_error_is_a_resilience_error():
    for name in errors.__all__:
        if name == "JobEnded":  # the end of a rank's part in the job: not an error
            continue
        assert issubclass(getattr(errors, name), errors.ResilienceError)


def test_job_ended_is_not_swallowed_by_except_exception():
    assert issubclass(errors.JobEnded, BaseException) and not issubclass(errors.JobEnded, Exception)


def test_slurm_command_error_one_line():
    e = SlurmCommandError(["scontrol", "update", "x"], 1, "\nbad node\nmore\n")
    assert str(e) == "`scontrol update x` failed (exit 1): bad node"
    assert e.argv == ["scontrol", "update", "x"] and e.returncode == 1
    assert "\n" not in str(SlurmCommandError(["a"], None, ""))


def test_fault_to_dict():
    f = Fault(kind=FaultKind.NODE_LOST, rank=2, node="n3", time=1.5, detail="x")
    assert f.to_dict() == {"kind": "node_lost", "rank": 2, "node": "n3", "time": 1.5, "detail": "x"}
    json.dumps(f.to_dict())


def _table(n=3, gen=0):
    return RankTable(generation=gen, slots=tuple(RankSlot(rank=i, node=f"n{i}", worker_id=f"w{i}") for i in range(n)))


def test_table_properties_and_roundtrip():
    t = _table(3, 5)
    assert t.world_size == 3 and t.nodes == ("n0", "n1", "n2")
    assert t.slot_for_node("n1").rank == 1 and t.slot_for_node("zz") is None
    doc = json.loads(t.to_json())
    assert doc["version"] == 1 and doc["generation"] == 5 and doc["world_size"] == 3 and len(doc["ranks"]) == 3
    assert RankTable.from_json(t.to_json()) == t
    assert t.to_json() == RankTable.from_json(t.to_json()).to_json()


@pytest.mark.parametrize(
    "slots,gen",
    [
        ((RankSlot(rank=1, node="a", worker_id="w"),), 0),
        ((RankSlot(rank=0, node="a", worker_id="w"), RankSlot(rank=1, node="a", worker_id="v")), 0),
        ((RankSlot(rank=0, node="a", worker_id="w"),), -1),
    ],
)
def test_table_invariants(slots, gen):
    with pytest.raises(RankTableError):
        RankTable(generation=gen, slots=slots)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"version": 2, "generation": 0, "world_size": 0, "ranks": []}',
        '{"version": 1, "generation": "0", "world_size": 0, "ranks": []}',
        '{"version": 1, "generation": 0, "world_size": 0}',
        '{"version": 1, "generation": 0, "world_size": 1, "ranks": [{"rank": 0, "node": "a"}]}',
        '{"version": 1, "generation": 0, "world_size": 1, "ranks": [{"rank": "0", "node": "a", "worker_id": "w"}]}',
        '{"version": 1, "generation": 0, "world_size": 1, "ranks": [{"rank": 0, "node": "a", "worker_id": "w", "x": 1}]}',
        '{"version": 1, "generation": 0, "world_size": 2, "ranks": [{"rank": 0, "node": "a", "worker_id": "w"}]}',
        '{"version": 1, "generation": 0, "world_size": 1, "ranks": [3]}',
    ],
)
def test_from_json_malformed(text):
    with pytest.raises(RankTableError) as ei:
        RankTable.from_json(text)
    assert "\n" not in str(ei.value)
