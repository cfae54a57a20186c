"""Supervisor survival: the keeper's restart loop, the persisted state, liveness reconnects."""

import io
import json
import socket
import sys
import types

import pytest

from slurm_resilience.errors import ResilienceError
from slurm_resilience.lifecycle import JobPhase
from slurm_resilience.protocol import Plan, PlanAction, StoreKey
from slurm_resilience.supervisor.executors import reattach
from slurm_resilience.supervisor.executors.keeper import EXIT_SUPERVISOR_LOST, _with_reattach, keep
from slurm_resilience.supervisor.decide.ranktable import initial_table
from slurm_resilience.worker.heartbeat import _closed


def test_reattach_flag_goes_before_the_training_command():
    assert _with_reattach(["sup", "--child", "--", "python", "t.py"]) == ["sup", "--child", "--reattach", "--", "python", "t.py"]
    assert _with_reattach(["sup"]) == ["sup", "--reattach"]


CHILD = """
import os, signal, sys
marker = sys.argv[1]
if "--reattach" in sys.argv:
    sys.exit(7)
open(marker, "w").close()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_keeper_restarts_a_killed_supervisor_with_reattach(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = io.StringIO()
    code = keep([sys.executable, str(script), str(tmp_path / "m"), "--", "train"], restarts=1, out=out)
    assert code == 7  # the restarted one ran with --reattach and its exit code is the job's
    assert "killed by signal 9" in out.getvalue()


def test_keeper_gives_up_after_its_restart_budget(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    out = io.StringIO()
    assert keep([sys.executable, str(script)], restarts=2, out=out) == EXIT_SUPERVISOR_LOST
    assert out.getvalue().count("killed by signal 9") == 3


def test_keeper_passes_a_normal_exit_through(tmp_path):
    assert keep([sys.executable, "-c", "raise SystemExit(3)"], restarts=3) == 3


def test_closed_tells_a_hung_up_peer_from_a_quiet_one():
    a, b = socket.socketpair()
    assert not _closed(a)
    b.close()
    assert _closed(a)
    a.close()


class _Store:
    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def multi_get(self, keys):
        return [self.d[k] for k in keys]

    def delete_key(self, k):
        return self.d.pop(k, None) is not None

    def check(self, keys):
        return all(k in self.d for k in keys)

    def add(self, k, n):
        self.d[k] = int(self.d.get(k, 0)) + n
        return self.d[k]


def test_state_file_round_trip_is_private_and_keeps_the_event_position(tmp_path):
    from slurm_resilience.supervisor.decide.state import SupervisorState, WorkerRecord
    from slurm_resilience.protocol import Role

    table = initial_table(["n1", "n2", "n3"], ["n1.1", "n2.2", "n3.3"], {n: "127.0.0.1" for n in ["n1", "n2", "n3"]})
    workers = {s.worker_id: WorkerRecord(worker_id=s.worker_id, node=s.node, role=Role.RANK, pid=100 + i)
               for i, s in enumerate(table.slots)}
    state = SupervisorState(job_id="9", phase=JobPhase.RECOVERING, table=table, target_world=3,
                            worker_nodes=("n1", "n2", "n3"), spare_nodes=("n4",),
                            addresses={n: "127.0.0.1" for n in ("n1", "n2", "n3", "n4")},
                            standbys={"n4": ("n4.4",)}, workers=workers, fault_retries_used=1, recoveries=2,
                            next_id=4, excluded=frozenset({"n5"}))
    reattach.save(str(tmp_path), state, events_seen=5)
    assert (tmp_path / reattach.STATE_FILE).stat().st_mode & 0o777 == 0o600
    back, seen, written = reattach.load(str(tmp_path))
    assert seen == 5 and written > 0 and back.table == table and back.standbys == {"n4": ("n4.4",)}
    assert back.workers["n2.2"].pid == 101 and back.fault_retries_used == 1 and back.recoveries == 2
    assert back.excluded == {"n5"} and back.next_id == 4
    assert back.phase is JobPhase.RUNNING  # an in-flight recovery's bookkeeping is not kept
    # the old supervisor published generation 1 after its last write (the spare took rank 1)
    import dataclasses

    slots = list(table.slots)
    slots[1] = dataclasses.replace(slots[1], node="n4", worker_id="n4.4")
    newer = dataclasses.replace(table, generation=1, slots=tuple(slots))
    adopted = reattach.adopt_plans(back, [Plan(1, PlanAction.RUN, newer, joining=(1,))])
    assert adopted.table.slots[1].node == "n4" and adopted.standbys == {}  # the spare became a rank


def test_load_without_state_is_a_one_line_error(tmp_path):
    with pytest.raises(ResilienceError, match="nothing to re-attach to"):
        reattach.load(str(tmp_path))
    (tmp_path / reattach.STATE_FILE).write_text(json.dumps({"version": 99}))
    with pytest.raises(ResilienceError, match="version 99"):
        reattach.load(str(tmp_path))


def test_negative_supervisor_respawns_is_a_one_line_config_error():
    from slurm_resilience.config import load_config
    from slurm_resilience.errors import ConfigError

    with pytest.raises(ConfigError, match="supervisor_respawns=-1 must be >= 0"):
        load_config({"job": {"supervisor_respawns": -1}})
    with pytest.raises(ConfigError, match="'job.supervisor_restarts' in .* was renamed 'job.supervisor_respawns'"):
        load_config({"job": {"supervisor_restarts": 3}})


def test_reattach_at_the_keeper_level_is_refused(capsys):
    from slurm_resilience.cli import main

    assert main(["local", "--reattach", "--", "true"]) == 2
    assert "--reattach is for the supervisor the batch step restarts" in capsys.readouterr().err


def test_keeper_does_not_restart_a_supervisor_ended_on_purpose(tmp_path):
    """scontrol requeue / scancel send SIGTERM to the whole batch step: no re-attach then."""
    script = tmp_path / "child.py"
    script.write_text("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    out = io.StringIO()
    assert keep([sys.executable, str(script)], restarts=3, out=out) == 128 + 15
    assert "restarting" not in out.getvalue()


def test_an_event_whose_writer_died_does_not_hold_up_the_later_ones(tmp_path, monkeypatch):
    """A worker killed between counting an event and writing it leaves a hole; the
    supervisor skips it after EVENT_HOLE_S and still takes it if it comes late."""
    from slurm_resilience.config import load_config
    from slurm_resilience.supervisor.observe import watch
    from slurm_resilience.supervisor.decide.state import SupervisorState

    monkeypatch.setattr(watch, "EVENT_HOLE_S", 0.0)
    store, seen = _Store(), []
    store.delete_key = lambda k: store.d.pop(k)
    events = types.SimpleNamespace(emit=lambda kind, **f: seen.append((kind, f.get("step"))),
                                   emit_many=lambda items: seen.extend((k, f.get("step")) for k, f in items))
    launcher = types.SimpleNamespace(node_reachable=lambda node, timeout_s: True,
                                     probe_slurmd=lambda node, steps, deadline_s: (True, "answered"))
    w = watch.Watch(cfg=load_config({}), store=store, seen=None, launcher=launcher, handles={}, events=events,
                    preempted=lambda: False)
    state = SupervisorState(job_id="1", phase=JobPhase.RUNNING, table=initial_table(["n1"], ["n1.1"], {"n1": "x"}),
                            target_world=1, worker_nodes=("n1",), spare_nodes=(), addresses={"n1": "x"})
    store.set(StoreKey.EVENT_COUNTER.value, "3")
    for n in (1, 3):
        store.set(StoreKey.EVENT.of(n),
                  json.dumps({"kind": "first_step", "step": n, "rank": 0, "generation": 0, "t": 1.0}))
    batches = w.poll_events(state) + w.poll_events(state)  # the hole at 2 is skipped
    assert seen == [("rank_first_step", 1), ("rank_first_step", 3)]
    marks = [m for batch in batches for m in batch.marks]  # recovery marks for decide, a batch per poll
    assert len(marks) == 2 and marks[0].rank == 0
    store.set(StoreKey.EVENT.of(2), json.dumps({"kind": "first_step", "step": 2}))  # the slow writer
    w.poll_events(state)
    assert seen[-1] == ("rank_first_step", 2) and w._late == {}


def test_a_worker_record_is_saved_with_every_field():
    import dataclasses

    from slurm_resilience.protocol import Role
    from slurm_resilience.supervisor.decide.state import WorkerRecord

    w = WorkerRecord(worker_id="n1.3", node="n1", role=Role.STANDBY, pid=41, connected=True, dead=True, step=7)
    assert w.to_dict() == dataclasses.asdict(w) | {"role": "standby"}  # a field added later must be saved too
