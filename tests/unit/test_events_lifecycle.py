import itertools
import os
import stat

import pytest

from slurm_resilience.errors import RecoveryError
from slurm_resilience.events import EventLog, format_timeline, read_events
from slurm_resilience.lifecycle import TRANSITIONS, JobPhase
from slurm_resilience.model import Fault, FaultKind, RankTable
from slurm_resilience.protocol import EventKind, RecoveryPhase, WorkerEvent
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.actions import move
from slurm_resilience.supervisor.decide.state import SupervisorState


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_event_log_roundtrip(tmp_path):
    path = str(tmp_path / "sub" / "events.jsonl")
    clock = Clock()
    with EventLog(path, clock=clock) as log:
        ev = log.emit("fault_detected", rank=2, node="n3", fault=Fault(kind=FaultKind.NODE_LOST, rank=2, node="n3", time=1.0))
        clock.t += 1.5
        log.emit("phase", recovery=1, phase="stop", start=1000.0, end=1000.25)
    assert ev["kind"] == "fault_detected" and ev["t"] == 1000.0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    events = read_events(path)
    assert [e["kind"] for e in events] == ["fault_detected", "phase"]
    assert events[0]["fault"]["kind"] == "node_lost"
    with EventLog(path) as log:  # append, not truncate
        log.emit("again")
    assert len(read_events(path)) == 3


def test_event_log_writes_enum_kinds_as_plain_strings(tmp_path):
    path = str(tmp_path / "events.jsonl")
    seen = []
    with EventLog(path, clock=Clock(), on_event=seen.append) as log:
        log.emit(EventKind.PHASE, recovery=1, phase=RecoveryPhase.RESTORE, start=0.0, end=1.0)
        log.emit(WorkerEvent.RESTORED.logged, rank=0)
    assert [type(e["kind"]) for e in seen] == [str, str]  # observers get what a reader gets
    assert read_events(path)[0] == {"t": 1000.0, "kind": "phase", "recovery": 1, "phase": "restore",
                                    "start": 0.0, "end": 1.0}
    assert read_events(path)[1]["kind"] == "rank_restored"


def test_read_truncated_last_line(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"t": 1, "kind": "a"}\n{"t": 2, "kind": "b"}\n{"t": 3, "ki')
    assert [e["kind"] for e in read_events(str(p))] == ["a", "b"]
    p.write_text('{"t": 1, "kind": "a"}\nbroken\n{"t": 2, "kind": "b"}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_events(str(p))


def test_format_timeline():
    events = [
        {"t": 100.0, "kind": "job_start", "nodes": 4},
        {"t": 112.345, "kind": "fault_detected", "rank": 2, "node": "n3", "detail": "slurmd unreachable"},
        {"t": 112.4, "kind": "recovery_start", "recovery": 1},
        {"t": 112.5, "kind": "phase", "recovery": 1, "phase": "stop", "start": 112.4, "end": 112.45},
        {"t": 113.0, "kind": "phase", "recovery": 1, "phase": "reconnect", "start": 112.45, "end": 112.95},
        {"t": 113.4, "kind": "recovery_done", "recovery": 1},
    ]
    text = format_timeline(events)
    lines = text.splitlines()
    assert lines[0] == "+0.000s  job_start  nodes=4"
    assert lines[1] == '+12.345s  fault_detected  rank=2 node=n3 detail="slurmd unreachable"'
    assert "recovery 1: 1000.0 ms" in text
    assert "  phase      duration_ms" in lines
    assert any(l.split() == ["stop", "50.0"] for l in lines)
    assert any(l.split() == ["reconnect", "500.0"] for l in lines)
    assert format_timeline([]) == "(no events)\n"
    assert "unfinished" in format_timeline(events[:4])


ALL_PAIRS = list(itertools.product(JobPhase, JobPhase))


def test_transitions_table_complete():
    assert set(TRANSITIONS) == set(JobPhase)
    assert TRANSITIONS[JobPhase.STARTING] == {JobPhase.RUNNING, JobPhase.FAILED}
    assert TRANSITIONS[JobPhase.RUNNING] == {JobPhase.RECOVERING, JobPhase.FINISHING, JobPhase.FAILED}
    assert TRANSITIONS[JobPhase.RECOVERING] == {JobPhase.RUNNING, JobPhase.FALLBACK_RELAUNCH, JobPhase.FAILED}
    assert TRANSITIONS[JobPhase.FALLBACK_RELAUNCH] == {JobPhase.RUNNING, JobPhase.FAILED}
    assert TRANSITIONS[JobPhase.FINISHING] == {JobPhase.SUCCEEDED, JobPhase.FAILED}
    assert not TRANSITIONS[JobPhase.SUCCEEDED] and not TRANSITIONS[JobPhase.FAILED]


def _in(phase: JobPhase) -> SupervisorState:
    return SupervisorState(job_id="7", phase=phase, table=RankTable(generation=0, slots=()), target_world=1,
                           worker_nodes=("n1",), spare_nodes=(), addresses={})


@pytest.mark.parametrize("frm,to", ALL_PAIRS)
def test_every_pair(frm, to):
    """Every phase change is a decision (``actions.move``) checked against TRANSITIONS."""
    if frm is to:
        assert move(_in(frm), to, "why") == (_in(frm), [])  # already there: nothing to do
    elif to in TRANSITIONS[frm]:
        state, acts = move(_in(frm), to, "why")
        assert state.phase is to and acts == [m.Phase(frm, to, "why")]
    else:
        with pytest.raises(RecoveryError, match=f"{frm.name} -> {to.name}"):
            move(_in(frm), to, "why")


def test_happy_path():
    state = _in(JobPhase.STARTING)
    for p in (JobPhase.RUNNING, JobPhase.RECOVERING, JobPhase.RUNNING, JobPhase.FINISHING, JobPhase.SUCCEEDED):
        state, _ = move(state, p, "")
    assert state.phase is JobPhase.SUCCEEDED and not TRANSITIONS[state.phase]


def test_emit_many_writes_a_polls_events_as_lines_in_order(tmp_path):
    """A poll's worker events go out in one write: the same lines, in order, as one emit each."""
    path, seen = str(tmp_path / "events.jsonl"), []
    with EventLog(path, clock=Clock(5.0), on_event=seen.append) as log:
        assert log.emit_many([]) == []
        got = log.emit_many([(WorkerEvent.RECONNECTED.logged, {"rank": 0}), ("rank_newer_kind", {"rank": 1}),
                             (EventKind.FAULT_DETECTED, {"fault": Fault(kind=FaultKind.NODE_LOST, rank=1,
                                                                        node="n3", time=1.0)})])
        log.emit("after", n=1)
    events = read_events(path)
    assert [e["kind"] for e in events] == ["rank_reconnected", "rank_newer_kind", "fault_detected", "after"]
    assert events[:2] == got[:2] == seen[:2] and got[2] is seen[2] and events[0]["t"] == 5.0
    assert events[2]["fault"]["node"] == "n3" and got[2]["fault"].node == "n3"  # returned as given
    with EventLog(path) as log, pytest.raises(TypeError):
        log.emit_many([("bad", {"x": object()})])  # not JSON-able: nothing of the batch written
    assert len(read_events(path)) == 4
