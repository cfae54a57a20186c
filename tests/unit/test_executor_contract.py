"""The executor contract (``supervisor/executors/contract.py``): both executors declare
the action types they carry out; every type of the ``Action`` union is handled by at
least one; a handled action is carried out (its adapter called), any other is refused
with ``UnhandledActionError`` by the one path the loop takes (``carry_out``).

Pure contract test: the adapters are recording fakes, no Slurm, store or process."""

import io
import logging
import os
import time
import typing
from types import SimpleNamespace

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.lifecycle import JobPhase
from slurm_resilience.model import RankTable
from slurm_resilience.protocol import EventKind, Plan, PlanAction, Role, StoreKey, preempt_request_path
from slurm_resilience.supervisor.adapters.launcher import CleansContainers, ReadsSlurmTimeouts, Requeues
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.state import SupervisorState, WorkerRecord
from slurm_resilience.supervisor.executors.contract import UnhandledActionError, carry_out
from slurm_resilience.supervisor.executors.online import Supervisor
from slurm_resilience.supervisor.executors.relaunch import RelaunchExecutor, layout

ALL_ACTIONS = frozenset(typing.get_args(m.Action))
TABLE = RankTable(generation=1, slots=())


class Recorder:
    """Any method call on it (or on an attribute of it) is recorded as (path, args)."""

    def __init__(self, calls: list, path: str, returns: dict | None = None):
        self._calls, self._path, self._returns = calls, path, returns or {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Recorder(self._calls, f"{self._path}.{name}", self._returns)

    def __call__(self, *args, **kwargs):
        self._calls.append((self._path, args, kwargs))
        return self._returns.get(self._path)


class Handle:
    name, node, process = "sr-w1", "n2", None

    def exit_code(self):
        return None  # running: a Reap past its grace kills it


def sample(kind: type) -> m.Action:
    """One instance of every action type."""
    return {
        m.Launch: m.Launch("w1", "n2", Role.RANK, 1),
        m.Relaunch: m.Relaunch(TABLE, 1),
        m.CheckSpare: m.CheckSpare("n5"),
        m.Kill: m.Kill("w1"),
        m.Publish: m.Publish(Plan(generation=1, action=PlanAction.PERSIST, table=TABLE, reason="t")),
        m.Isolate: m.Isolate("n3", "DOWN", "lost"),
        m.Emit: m.emit(EventKind.PLAN, generation=1),
        m.Say: m.Say("hello"),
        m.Phase: m.Phase(JobPhase.STARTING, JobPhase.RUNNING, "t"),
        m.ShutDownStandbys: m.ShutDownStandbys(),
        m.Reap: m.Reap(0.0),
        m.DrainEvents: m.DrainEvents(),
        m.Requeue: m.Requeue(),
        m.Exit: m.Exit(3, "it failed"),
    }[kind]


def state() -> SupervisorState:
    s = SupervisorState(job_id="7", phase=JobPhase.RUNNING, table=TABLE, target_world=1, worker_nodes=("n2",),
                        spare_nodes=("n5",), addresses={"n2": "10.0.0.2", "n5": "10.0.0.5"})
    return s.with_worker(WorkerRecord(worker_id="w1", node="n2", role=Role.RANK))


def online(tmp_path, calls):
    """The online executor with recording adapters (its constructor starts a store and
    a liveness server: the contract needs neither)."""
    sup = object.__new__(Supervisor)
    launcher = Recorder(calls, "launcher", {"launcher.launch": Handle()})
    sup.__dict__.update(
        launcher=launcher, store=Recorder(calls, "store"), isolator=Recorder(calls, "isolator"),
        checker=Recorder(calls, "checker"), events=Recorder(calls, "events"), watch=Recorder(calls, "watch"),
        handles={"w1": Handle()}, job_dir=str(tmp_path), out=io.StringIO(), _t0=time.time(), store_host="h",
        store_port=1, liveness=SimpleNamespace(port=2, tell=Recorder(calls, "liveness.tell")), token="t" * 32, config_path="c.yaml", job_id="7",
        run_id="r", _nccl_env={}, command=["python", "t.py"], _unsaved=False)
    return sup


def relaunch(tmp_path, calls):
    launcher = Recorder(calls, "launcher")
    sup = RelaunchExecutor(config=load_config({"run": {"warm": False}}), command=["python", "t.py"],
                           job_dir=str(tmp_path), job_id="7", layout=layout(["n1", "n2"], "n1", 1),
                           allocation=["n1", "n2"], launcher=launcher, out=io.StringIO())
    sup.isolator, sup.events = Recorder(calls, "isolator"), Recorder(calls, "events")
    sup._launch = Recorder(calls, "relaunch_step")  # the step itself is srun's (tests/unit/test_relaunch*.py)
    calls.clear()  # what the constructor asked (the nodes' addresses)
    return sup


# action type -> what carrying it out must have done: a recorded call, or a check
ONLINE_EFFECT = {
    m.Launch: "launcher.launch", m.Kill: "launcher.kill", m.Publish: "liveness.tell", m.Isolate: "isolator.start",
    m.CheckSpare: "checker.start", m.Emit: "events.emit", m.ShutDownStandbys: "liveness.tell",
    m.Reap: "launcher.kill", m.DrainEvents: "watch.poll_events", m.Requeue: "launcher.requeue",
}
RELAUNCH_EFFECT = {
    m.Relaunch: "relaunch_step", m.Isolate: "isolator.start", m.Emit: "events.emit", m.Requeue: "launcher.requeue",
}


def test_every_action_is_some_executors_and_each_declares_a_subset():
    assert Supervisor.HANDLES <= ALL_ACTIONS and RelaunchExecutor.HANDLES <= ALL_ACTIONS
    assert Supervisor.HANDLES | RelaunchExecutor.HANDLES == ALL_ACTIONS
    assert m.Relaunch not in Supervisor.HANDLES
    assert {m.Launch, m.Kill, m.CheckSpare} & RelaunchExecutor.HANDLES == set()


@pytest.mark.parametrize("kind", sorted(ALL_ACTIONS, key=lambda t: t.__name__), ids=lambda t: t.__name__)
def test_online_executor_carries_out_what_it_handles_and_refuses_the_rest(kind, tmp_path, capsys, caplog):
    calls = []
    sup = online(tmp_path, calls)
    action = sample(kind)
    if kind not in Supervisor.HANDLES:
        with pytest.raises(UnhandledActionError, match=f"Supervisor does not carry out {kind.__name__}"):
            carry_out(sup, state(), action)
        assert calls == []
        return
    with caplog.at_level(logging.INFO):
        carry_out(sup, state(), action)
    deadline = time.monotonic() + 10  # Kill runs in a thread: the faulty node may answer nothing
    while kind is m.Kill and not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    done = [path for path, _, _ in calls]
    if kind in ONLINE_EFFECT:
        assert ONLINE_EFFECT[kind] in done, done
    if kind in (m.Publish, m.ShutDownStandbys):  # the store first, then the nodes' pulses
        assert done.index("store.set") < done.index("liveness.tell"), done
    if kind is m.ShutDownStandbys:
        assert calls[0][1][0] == StoreKey.SHUTDOWN.value
    if kind is m.Publish:
        assert os.listdir(tmp_path), "the rank table is written before the plan"
    if kind is m.Say:
        assert "hello" in sup.out.getvalue()
    if kind is m.Phase:
        assert "job phase STARTING -> RUNNING" in caplog.text
    if kind is m.Exit:
        assert "slurm-resilience: error: it failed" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(ALL_ACTIONS, key=lambda t: t.__name__), ids=lambda t: t.__name__)
def test_relaunch_executor_carries_out_what_it_handles_and_refuses_the_rest(kind, tmp_path, capsys):
    calls = []
    sup = relaunch(tmp_path, calls)
    action = sample(kind)
    if kind not in RelaunchExecutor.HANDLES:
        with pytest.raises(UnhandledActionError, match=f"RelaunchExecutor does not carry out {kind.__name__}"):
            carry_out(sup, state(), action)
        assert calls == []
        return
    out = carry_out(sup, state(), action)
    done = [path for path, _, _ in calls]
    if kind in RELAUNCH_EFFECT:
        assert RELAUNCH_EFFECT[kind] in done, done
    if kind is m.Relaunch:
        assert out == [m.Published(1, out[0].t)]
    if kind is m.Publish:  # a PERSIST plan: the request file the program looks for
        assert os.path.exists(preempt_request_path(str(tmp_path)))
    if kind is m.Phase:
        assert os.path.exists(os.path.join(tmp_path, "status.json"))
    if kind is m.Say:
        assert "hello" in sup.out.getvalue()
    if kind is m.Exit:
        assert "slurm-resilience: error: it failed" in capsys.readouterr().err
    if kind in (m.ShutDownStandbys, m.DrainEvents):
        assert calls == []  # nothing to do: no standbys, no worker events


def test_capabilities_are_typed_protocols():
    class Local:  # the local launcher: none of a scheduler's capabilities
        def launch(self, **kw):
            pass

    class InScheduler(Local):
        def requeue(self):
            pass

        def clean_containers(self, nodes, *, stale=False):
            return {}

        def slurm_timeouts(self):
            return (None, None)

    assert not any(isinstance(Local(), p) for p in (Requeues, CleansContainers, ReadsSlurmTimeouts))
    assert all(isinstance(InScheduler(), p) for p in (Requeues, CleansContainers, ReadsSlurmTimeouts))
