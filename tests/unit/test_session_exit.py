"""The Session facade in one process (a world of one): how a rank's part in the job ends.

A real TCPStore and a listening socket stand in for the supervisor; the test
publishes the plans. Checks that every early ending leaves the process with the
same exit status as before (fenced/stopped/persisted/standby 0, aborted 3) and that
the code after the ``with Session()`` block runs only when training finished.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slurm_resilience import Session
from slurm_resilience.model import RankSlot, RankTable
from slurm_resilience.protocol import Plan, PlanAction, StoreKey, write_token

pytestmark = pytest.mark.timeout(90)


class FakeSupervisor:
    """The store (under the job's token) and a liveness socket; publishes plans."""

    def __init__(self, tmp_path, *, role="rank", preempt_signal=""):
        self.server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
        self.store = dist.PrefixStore("tok/", self.server)
        self.liveness = socket.socket()
        self.liveness.bind(("127.0.0.1", 0))
        self.liveness.listen(8)
        self.job_dir = tmp_path / "job"
        self.job_dir.mkdir()
        write_token(str(self.job_dir), "tok")
        cfg = tmp_path / "config.yaml"
        cfg.write_text(json.dumps({
            "job": {"preempt_signal": preempt_signal},
            "reconnect": {"poll_interval_ms": 5, "pg_timeout_s": 10},
            # below pg_timeout_s (the hierarchy). No node pulse: this fake supervisor sets
            # plans in the store only and never tells a pulse, so a relaying pulse would
            # let the rank wait up to plan_watch.STORE_FALLBACK_S before it asks the store,
            # and a plan published in one step would be seen some steps later.
            "detect": {"progress_soft_s": 4, "progress_hard_s": 8, "pulse": False},
            "checkpoint": {"local_dir": str(tmp_path / "local/{node}/ckpt")},
        }))
        self.environ = {
            "SR_STORE_ADDR": "127.0.0.1", "SR_STORE_PORT": str(self.server.port),
            "SR_LIVENESS_PORT": str(self.liveness.getsockname()[1]), "SR_JOB_DIR": str(self.job_dir),
            "SR_WORKER_ID": "w0", "SR_NODE": "n0", "SR_ROLE": role, "SR_GENERATION": "0",
            "SR_CONFIG": str(cfg), "SR_JOB_ID": "1", "SR_RUN_ID": "0" * 32,
        }

    def publish(self, g, action=PlanAction.RUN, worker="w0", reason=""):
        table = RankTable(generation=g, slots=(RankSlot(rank=0, node="n0", worker_id=worker),))
        self.store.set(StoreKey.PLAN.of(g), Plan(g, action, table, reason=reason).to_json())

    def events(self):
        n = int(self.store.add(StoreKey.EVENT_COUNTER.value, 0))
        return [json.loads(self.store.get(StoreKey.EVENT.of(i))) for i in range(1, n + 1)]

    def kinds(self):
        return [e["kind"] for e in self.events()]

    def close(self):
        self.liveness.close()


@pytest.fixture
def sup(tmp_path):
    s = FakeSupervisor(tmp_path)
    yield s
    s.close()


def _train(session, steps, during=lambda index: None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.register(model=model, optimizer=opt)
    session.extras.setdefault("seen", 0)
    for step in session.steps(steps):
        with step:
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            session.all_reduce_gradients(model)
            opt.step()
            session.extras["seen"] += 1
            during(step.index)
    return model


def test_finished_training_runs_the_code_after_the_block(sup):
    sup.publish(0)
    after = False
    with Session(sup.environ) as session:
        _train(session, 3)
        assert (session.rank, session.world_size, session.generation, session.step) == (0, 1, 0, 3)
    after = True
    assert after and (sup.job_dir / "final.pt").exists()
    final = torch.load(sup.job_dir / "final.pt", weights_only=False)
    assert (final["step"], final["extras"]["seen"]) == (3, 3)
    assert sup.store.get(StoreKey.DONE.of(0)) == b"3"
    assert sup.kinds() == ["reconnected", "restored", "first_step", "done"]


def _ended(sup, steps=4, during=lambda index: None):
    """Run a session; returns (exit code, whether the code after the block ran)."""
    after = False
    with pytest.raises(SystemExit) as info:
        with Session(sup.environ) as session:
            _train(session, steps, during)
        after = True
    return info.value.code, after


def test_fenced_at_start_exits_0_before_the_block(sup):
    sup.publish(0, worker="someone-else")
    assert _ended(sup) == (0, False)
    assert sup.kinds() == ["fenced"]


def test_stop_plan_exits_0(sup):
    sup.publish(0, PlanAction.STOP, reason="requeue")
    assert _ended(sup) == (0, False)
    assert sup.kinds() == ["stopped"]


def test_standby_at_the_jobs_end_exits_0(tmp_path):
    sup = FakeSupervisor(tmp_path, role="standby")
    sup.store.set(StoreKey.SHUTDOWN.value, "1")
    try:
        assert _ended(sup) == (0, False)
        assert sup.kinds() == []
    finally:
        sup.close()


def test_abort_at_a_safe_point_exits_3_with_a_snapshot(sup):
    sup.publish(0)
    code, after = _ended(sup, during=lambda i: i == 1 and sup.publish(1, PlanAction.ABORT, reason="no spare"))
    assert (code, after) == (3, False)
    assert sup.kinds()[-1] == "aborted"
    snap = sup.job_dir / "snapshots" / "rank0-step00000002.pt"
    assert torch.load(snap, weights_only=False)["step"] == 2


def test_fenced_at_a_safe_point_exits_0(sup):
    sup.publish(0)
    assert _ended(sup, during=lambda i: i == 0 and sup.publish(1, worker="replacement")) == (0, False)
    assert sup.kinds()[-1] == "fenced"


def test_persist_plan_writes_disk_tiers_and_exits_0(sup):
    sup.publish(0)
    assert _ended(sup, during=lambda i: i == 1 and sup.publish(1, PlanAction.PERSIST)) == (0, False)
    persisted = [e for e in sup.events() if e["kind"] == "persisted"]
    assert len(persisted) == 1 and persisted[0]["step"] == 2 and persisted[0]["committed"]


def test_preemption_signal_becomes_a_persist_request(tmp_path):
    sup = FakeSupervisor(tmp_path, preempt_signal="USR2@60")
    sup.publish(0)
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with Session(sup.environ) as session:
            _train(session, 3, during=lambda i: i == 1 and os.kill(os.getpid(), signal.SIGUSR2))
        assert sup.store.get(StoreKey.PERSIST_REQUEST.value) == b"2"
    finally:
        signal.signal(signal.SIGUSR2, old)
        sup.close()


def test_stopped_rank_launched_by_the_supervisor_skips_the_teardown(sup):
    """With SR_FAST_EXIT=1 (the supervisor's launch) a stopped rank runs its own
    ``finally`` and exits 0 at once: an atexit handler registered before is skipped."""
    import subprocess
    import sys

    sup.publish(0, PlanAction.STOP, reason="requeue")
    code = ("import atexit\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            "from slurm_resilience import Session\n"
            "try:\n"
            "    with Session() as session:\n"
            "        print('trained')\n"
            "finally:\n"
            "    print('finally ran', end='')\n")
    env = {**os.environ, **sup.environ, "SR_FAST_EXIT": "1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, "finally ran"), p.stderr[-2000:]
    assert sup.kinds() == ["stopped"]


def test_an_aborted_rank_without_a_group_is_named_by_its_own_slot_not_its_nodes_first():
    """Issue 24's hidden bug: with G = 2 both ranks of a node aborted as the node's first
    rank (``slot_for_node``); the rank comes from this worker's own slot."""
    import types

    from slurm_resilience.protocol import Plan, PlanAction
    from slurm_resilience.supervisor.decide.ranktable import initial_table

    table = initial_table(["n1", "n2"], ["n1.a", "n1.b", "n2.a", "n2.b"], {"n1": "x", "n2": "y"}, tasks_per_node=2)
    plan = Plan(generation=0, action=PlanAction.RUN, table=table)
    ranks = {}
    for wid in ("n1.a", "n1.b", "n2.b", "elsewhere"):
        s = object.__new__(Session)  # no environment: only the rank lookup is used
        s._parts = types.SimpleNamespace(members=types.SimpleNamespace(group=None, plan=plan))
        s._env = types.SimpleNamespace(worker_id=wid, node=wid.split(".")[0])
        ranks[wid] = s._own_rank()
    assert ranks == {"n1.a": 0, "n1.b": 1, "n2.b": 3, "elsewhere": None}
