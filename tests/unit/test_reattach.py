"""Supervisor survival: the keeper's restart loop, the persisted state, liveness reconnects."""

import io
import json
import socket
import sys
import types

import pytest

from slurm_resilience.errors import ResilienceError
from slurm_resilience.lifecycle import JobPhase, Lifecycle
from slurm_resilience.protocol import EVENT_COUNTER, Plan, PlanAction, event_key, plan_key
from slurm_resilience.supervisor import reattach
from slurm_resilience.supervisor.keeper import EXIT_SUPERVISOR_LOST, _with_reattach, keep
from slurm_resilience.supervisor.ranktable import initial_table
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

    def check(self, keys):
        return all(k in self.d for k in keys)

    def add(self, k, n):
        self.d[k] = int(self.d.get(k, 0)) + n
        return self.d[k]


class _Launcher:
    def attach(self, *, name, node, pid):
        return types.SimpleNamespace(name=name, node=node, pid=pid, process=None)


def _sup(tmp_path, table):
    from slurm_resilience.supervisor.loop import Worker

    sup = types.SimpleNamespace(
        job_id="7", job_dir=str(tmp_path), lifecycle=Lifecycle(JobPhase.RECOVERING), table=table,
        target_world=3, worker_nodes=["n1", "n2", "n3"], spare_nodes=["n4"], standbys={"n4": "n4.4"},
        excluded=set(), returning=set(), restarts={1: 1}, recoveries=2, _ids=4, _ev_seen=3,
        workers={}, launcher=_Launcher(), store=_Store())
    for s in table.slots:
        sup.workers[s.worker_id] = Worker(s.worker_id, s.node, _Launcher().attach(name=f"sr-{s.worker_id}", node=s.node, pid=100 + s.rank))
    sup.workers["n4.4"] = Worker("n4.4", "n4", _Launcher().attach(name="sr-n4.4", node="n4", pid=200))
    return sup


def test_state_round_trip_adopts_newer_plans_and_skips_read_events(tmp_path):
    table = initial_table(["n1", "n2", "n3"], ["n1.1", "n2.2", "n3.3"], {n: "127.0.0.1" for n in ["n1", "n2", "n3"]})
    old = _sup(tmp_path, table)
    reattach.save(old)
    state = reattach.load(str(tmp_path))
    assert (tmp_path / reattach.STATE_FILE).stat().st_mode & 0o777 == 0o600
    # after the save, the old supervisor published generation 1 (the spare takes rank 1)
    slots = list(table.slots)
    import dataclasses

    slots[1] = dataclasses.replace(slots[1], node="n4", worker_id="n4.4")
    newer = dataclasses.replace(table, generation=1, slots=tuple(slots))
    new = _sup(tmp_path, table)
    new.workers, new.standbys, new.lifecycle = {}, {}, None
    new.store.set(plan_key(1), Plan(1, PlanAction.RUN, newer, joining=(1,)).to_json())
    new.store.set(EVENT_COUNTER, "6")
    new.store.set(event_key(6), "{}")  # 4 and 5 were read (and deleted) by the old one
    taken = reattach.reattach(new, state)
    assert new.table.generation == 1 and new.table.slots[1].node == "n4"
    assert new.standbys == {}  # the spare became a rank
    assert sorted(taken) == ["n1.1", "n2.2", "n3.3", "n4.4"]
    assert new.workers["n2.2"].handle.pid == 101
    assert new._ev_seen == 5 and new.restarts == {1: 1} and new.recoveries == 2
    assert new.lifecycle.phase is JobPhase.RUNNING  # an in-flight recovery's bookkeeping is not kept


def test_load_without_state_is_a_one_line_error(tmp_path):
    with pytest.raises(ResilienceError, match="nothing to re-attach to"):
        reattach.load(str(tmp_path))
    (tmp_path / reattach.STATE_FILE).write_text(json.dumps({"version": 99}))
    with pytest.raises(ResilienceError, match="version 99"):
        reattach.load(str(tmp_path))


def test_negative_supervisor_restarts_is_a_one_line_config_error():
    from slurm_resilience.config import load_config
    from slurm_resilience.errors import ConfigError

    with pytest.raises(ConfigError, match="supervisor_restarts=-1 must be >= 0"):
        load_config({"job": {"supervisor_restarts": -1}})


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
    from slurm_resilience.supervisor import loop

    monkeypatch.setattr(loop, "EVENT_HOLE_S", 0.0)
    sup = loop.Supervisor(config=load_config({}), command=["x"], job_dir=str(tmp_path),
                          nodes=[f"n{i}" for i in range(5)], launcher=None, store_host="127.0.0.1")
    sup.store, seen = _Store(), []
    sup.events = types.SimpleNamespace(emit=lambda kind, **f: seen.append((kind, f.get("step"))))
    sup.store.set(EVENT_COUNTER, "3")
    for n in (1, 3):
        sup.store.set(event_key(n), json.dumps({"kind": "first_step", "step": n}))
    sup.store.delete_key = lambda k: sup.store.d.pop(k)
    sup._poll_worker_events()  # notices the hole at 2
    sup._poll_worker_events()  # skips it
    assert seen == [("rank_first_step", 1), ("rank_first_step", 3)]
    sup.store.set(event_key(2), json.dumps({"kind": "first_step", "step": 2}))  # the slow writer
    sup._poll_worker_events()
    assert seen[-1] == ("rank_first_step", 2) and sup._ev_late == {}
