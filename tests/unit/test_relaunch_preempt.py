"""Preemption of a `run` job (supervisor/executors/relaunch_preempt.py): the request, the wait, the
requeue — the pure parts, then the relaunch loop against a fake srun and launcher."""

import os
import stat
import threading

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.events import read_events
from slurm_resilience.protocol import RUN_JOB_DIR_VAR
from slurm_resilience.supervisor.executors import relaunch_preempt
from slurm_resilience.supervisor.executors.relaunch import RelaunchExecutor, layout

# The step's program: "persist" waits for the request and exits 0 (what the Lightning
# callback does after its last step); "ignore" never looks (an unmodified program).
FAKE_SRUN = """#!{python}
import os, sys, time
req = os.path.join(os.environ["SR_RUN_JOB_DIR"], "preempt.request")
open(os.path.join(os.environ["SR_RUN_JOB_DIR"], "started"), "w").close()
while os.environ["FAKE_PROGRAM"] == "persist" and not os.path.exists(req):
    time.sleep(0.01)
if os.environ["FAKE_PROGRAM"] == "ignore":
    time.sleep(60)
sys.exit(0)
"""


def test_wait_is_the_grace_at_most_half_the_lead_time():
    assert relaunch_preempt.persist_wait_s(120.0, "USR1@90") == 45
    assert relaunch_preempt.persist_wait_s(20.0, "USR2@60") == 20.0
    assert relaunch_preempt.persist_wait_s(20.0, "") == 20.0


def test_request_is_written_whole_and_cleared(tmp_path):
    path = relaunch_preempt.write_request(str(tmp_path), signal_name="USR1")
    assert path == str(tmp_path / "preempt.request") and open(path).read().startswith("USR1 ")
    relaunch_preempt.clear_request(str(tmp_path))
    relaunch_preempt.clear_request(str(tmp_path))  # none: no error
    assert not os.path.exists(path)


class FakeLauncher:
    def __init__(self):
        self.killed, self.requeued = [], 0

    def node_reachable(self, node, timeout_s):
        return True

    def node_states(self, nodes):
        return {n: "MIXED" for n in nodes}

    def address(self, node):
        return "127.0.0.1"

    def kill(self, step):
        self.killed.append(step.name)
        step.process.kill()

    def requeue(self):
        self.requeued += 1


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")


def _preempt_when_started(sup, job_dir):
    def go():
        while not os.path.exists(os.path.join(job_dir, "started")):
            threading.Event().wait(0.01)
        sup.preempted.set()  # what the signal handler does
    threading.Thread(target=go, daemon=True).start()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("program, signal, cancelled", [("persist", "USR1@90", []), ("ignore", "USR1@1", ["sr-restart-0"])])
def test_preempted_step_is_asked_to_persist_then_the_job_is_requeued(tmp_path, fake_srun, monkeypatch,
                                                                     program, signal, cancelled):
    monkeypatch.setenv("FAKE_PROGRAM", program)
    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    open(os.path.join(job_dir, "preempt.request"), "w").close()  # an earlier run's: cleared at launch
    cfg = load_config({"job": {"preempt_signal": signal}, "run": {"warm": False}})
    launcher = FakeLauncher()
    sup = RelaunchExecutor(config=cfg, command=["python", "t.py"], job_dir=job_dir, job_id="77",
                           layout=layout(["n1", "n2", "n3"], "n1", 2), allocation=["n1", "n2", "n3"],
                           launcher=launcher, poll_s=0.02, probe_every_s=0.05)
    _preempt_when_started(sup, job_dir)
    assert sup.run() == 4  # EXIT_REQUEUED
    assert launcher.requeued == 1 and launcher.killed == cancelled
    kinds = [e["kind"] for e in read_events(os.path.join(job_dir, "events.jsonl"))]
    assert kinds.index("requeue_start") < kinds.index("requeue") and "job_done" not in kinds


def test_a_warm_rank_gets_the_job_directory_as_a_cold_one_does():
    from slurm_resilience.zygote_protocol import ForkRequest, decode, encode, warm_env

    req = ForkRequest(rank=1, local_rank=1, node_index=0, step_nodes=("n2",), tasks_per_node=2, step_name="sr-restart-0",
                      master_addr="127.0.0.1", master_port=20001, restart=0, command=("python", "t.py"), cwd="/",
                      umask=0o22, log_path="/j/step-000.log", job_dir="/j")
    assert decode(encode(req)) == req
    env = warm_env({"PATH": "/bin"}, req, job_nodelist="n2")
    assert env[RUN_JOB_DIR_VAR] == "/j"
    assert RUN_JOB_DIR_VAR not in warm_env({}, ForkRequest(**{**req.__dict__, "job_dir": ""}),
                                                         job_nodelist="n2")
