"""srun argv and the hetjob side of SrunLauncher: steps on component 1, listed and
cancelled under the component's job id; an isolated node leaves the component first."""

import subprocess

import pytest

from slurm_resilience.errors import RecoveryError, SlurmCommandError
from slurm_resilience.slurm import commands, steps
from slurm_resilience.slurm.steps import SrunLauncher, SrunStep, nodes_after_release, srun_argv


def test_srun_argv_plain_and_het_group():
    plain = srun_argv(job_id="42", name="sr-w1", nodes=["n3"])
    assert plain == ["srun", "--no-kill", "--overlap", "-N", "1", "-n", "1", "--ntasks-per-node=1", "-w", "n3",
                     "--jobid=42", "--job-name=sr-w1", "--kill-on-bad-exit=0"]
    het = srun_argv(job_id="40", name="sr-w1", nodes=["n3"], het_group=1)
    assert het == [*plain[:10], "--jobid=40", "--het-group=1", *plain[11:]]  # the leader's id, not 41
    assert not any(a.startswith("--het-group") for a in plain)


def test_srun_argv_ends_the_step_on_a_bad_exit_only_when_asked():
    argv = srun_argv(job_id="42", name="s", nodes=["n3"], mpi=True, end_on_bad_exit=True)
    assert "--kill-on-bad-exit=1" in argv and "--kill-on-bad-exit=0" not in argv
    # the toolkit owns the option: job.srun_options may not set it (slurm/options.py OWNED_SRUN)


@pytest.mark.parametrize("node", ["-n1", "n1;x", ""])
def test_srun_argv_rejects_bad_node(node):
    with pytest.raises(ValueError):
        srun_argv(job_id="42", name="sr-w1", nodes=[node])


def test_srun_argv_rejects_negative_group():
    with pytest.raises(ValueError, match="het_group"):
        srun_argv(job_id="42", name="sr-w1", nodes=["n1"], het_group=-1)


COMPONENT = {"JobId": "41", "NodeList": "n[2-5]", "BatchHost": "n2"}


def test_release_leaves_the_node_out():
    assert nodes_after_release(COMPONENT, "n4") == ["n2", "n3", "n5"]
    assert nodes_after_release({**COMPONENT, "NodeList": "n[2,5]"}, "n5") == ["n2"]


@pytest.mark.parametrize("job", [COMPONENT, {**COMPONENT, "NodeList": "(null)"}, {"JobId": "41"}])
def test_release_of_a_node_not_in_the_job_is_nothing(job):
    assert nodes_after_release(job, "n9") is None


def test_release_of_the_batch_host_is_impossible():
    with pytest.raises(RecoveryError, match="n2 is the first node"):
        nodes_after_release(COMPONENT, "n2")


class FakeSlurm:
    """commands.* replaced: records calls; scontrol show job answers COMPONENT."""

    def __init__(self, monkeypatch, fail_update=False):
        self.calls = []
        self.job = dict(COMPONENT)
        self.fail_update = fail_update
        monkeypatch.setattr(commands, "show_nodes", lambda names: {
            n: {"NodeName": n, "NodeAddr": "127.0.0.1", "Port": "17001"} for n in names})
        monkeypatch.setattr(commands, "show_job", self.show_job)
        monkeypatch.setattr(commands, "set_job_nodes", self.set_job_nodes)
        monkeypatch.setattr(commands, "set_node_state", lambda *a: self.calls.append(("state", *a)))
        monkeypatch.setattr(commands, "cancel_step", lambda *a, **kw: self.calls.append(("scancel", *a)))
        monkeypatch.setattr(commands, "run", self.run)

    def show_job(self, job_id):
        self.calls.append(("show_job", job_id))
        return self.job

    def set_job_nodes(self, job_id, nodes):
        self.calls.append(("set_job_nodes", job_id, list(nodes)))
        if self.fail_update:
            raise SlurmCommandError(["scontrol"], 1, "Invalid node name specified")
        self.job = {**self.job, "NodeList": ",".join(nodes)}

    def run(self, argv, **kw):
        self.calls.append(("run", *argv))
        return subprocess.CompletedProcess(argv, 0, "41.0 sr-w1\n41.1 sr-w2\n40.batch batch\n", "")


def _het(monkeypatch, **kw):
    fake = FakeSlurm(monkeypatch, **kw)
    return fake, SrunLauncher("40", ["n2", "n3", "n4", "n5", "n1"], het_group=1, het_job_id="41")


def test_het_isolate_releases_the_node_before_marking_it(monkeypatch):
    fake, launcher = _het(monkeypatch)
    launcher.isolate("n4", "DOWN", "lost")
    assert fake.calls == [("show_job", "41"), ("set_job_nodes", "41", ["n2", "n3", "n5"]),
                          ("state", "n4", "DOWN", "lost")]
    launcher.isolate("n4", "DOWN", "again")  # already released: only marked
    assert fake.calls[-2:] == [("show_job", "41"), ("state", "n4", "DOWN", "again")]


def test_het_isolate_failure_leaves_the_node_unmarked(monkeypatch):
    fake, launcher = _het(monkeypatch, fail_update=True)
    with pytest.raises(SlurmCommandError):
        launcher.isolate("n4", "DOWN", "lost")
    with pytest.raises(RecoveryError):
        launcher.isolate("n2", "DOWN", "lost")  # the component's first node
    assert not any(c[0] == "state" for c in fake.calls)


def test_plain_isolate_only_marks(monkeypatch):
    fake = FakeSlurm(monkeypatch)
    SrunLauncher("42", ["n2"]).isolate("n2", "DRAIN", "slow")
    assert fake.calls == [("state", "n2", "DRAIN", "slow")]


def test_het_kill_lists_and_cancels_under_the_component_id(monkeypatch):
    fake, launcher = _het(monkeypatch)

    class Done:
        def poll(self):
            return 0

    launcher.kill(SrunStep(name="sr-w2", node="n3", process=Done()))
    assert fake.calls == [("run", "squeue", "-h", "-s", "-j", "41", "-o", "%i %j"), ("scancel", "41", "1")]


def test_het_group_needs_the_component_job_id(monkeypatch):
    FakeSlurm(monkeypatch)
    for kw in ({"het_group": 1}, {"het_job_id": "41"}):
        with pytest.raises(ValueError, match="together"):
            SrunLauncher("40", ["n2"], **kw)


def test_het_launch_uses_the_leader_and_group(monkeypatch, tmp_path):
    _, launcher = _het(monkeypatch)
    seen = {}

    def fake_popen(argv, **kw):
        seen["argv"] = argv
        return "proc"

    monkeypatch.setattr(steps.subprocess, "Popen", fake_popen)
    step = launcher.launch(name="sr-w1", node="n3", argv=["python", "t.py"], env={}, log_path=str(tmp_path / "l"))
    assert seen["argv"] == [*srun_argv(job_id="40", name="sr-w1", nodes=["n3"], het_group=1), "python", "t.py"] and step.node == "n3"


class FakeProc:
    def __init__(self):
        self.killed = False

    def poll(self):
        return -9 if self.killed else None

    def kill(self):
        self.killed = True


def test_het_release_ends_the_srun_clients_on_that_node(monkeypatch, tmp_path):
    """A resize does not notify srun (a node failure would): the client would wait forever."""
    fake, launcher = _het(monkeypatch)
    procs = {}
    monkeypatch.setattr(steps.subprocess, "Popen", lambda argv, **kw: procs.setdefault(argv[argv.index("-w") + 1], FakeProc()))
    for node in ("n3", "n4"):
        launcher.launch(name=f"sr-{node}", node=node, argv=["x"], env={}, log_path=str(tmp_path / node))
    launcher.isolate("n3", "DOWN", "lost")
    assert procs["n3"].killed and not procs["n4"].killed
    fake.fail_update = True
    with pytest.raises(SlurmCommandError):
        launcher.isolate("n4", "DOWN", "lost")
    assert not procs["n4"].killed  # not released: its step is Slurm's to end
