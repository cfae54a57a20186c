import subprocess

import pytest

from slurm_resilience.errors import SlurmCommandError
from slurm_resilience.slurm import commands


def test_run_ok():
    proc = commands.run(["true"])
    assert proc.returncode == 0 and proc.stdout == ""


def test_run_nonzero():
    with pytest.raises(SlurmCommandError) as ei:
        commands.run(["false"])
    assert ei.value.returncode == 1 and ei.value.argv == ["false"]
    assert str(ei.value) == "`false` failed (exit 1)"
    assert commands.run(["false"], check=False).returncode == 1


def test_run_stderr_first_line():
    with pytest.raises(SlurmCommandError) as ei:
        commands.run(["sh", "-c", "echo boom >&2; echo two >&2; exit 3"])
    assert str(ei.value) == "`sh -c echo boom >&2; echo two >&2; exit 3` failed (exit 3): boom"


def test_run_timeout():
    with pytest.raises(SlurmCommandError) as ei:
        commands.run(["sleep", "5"], timeout=0.2)
    assert ei.value.returncode is None and ei.value.stderr == "timed out after 0.2s"


def test_run_missing_binary():
    with pytest.raises(SlurmCommandError) as ei:
        commands.run(["srun-does-not-exist", "x"])
    assert "`srun-does-not-exist` not found: install Slurm (scripts/install-deps.sh)" in str(ei.value)
    assert ei.value.returncode is None


def test_run_env():
    proc = commands.run(["sh", "-c", "echo $FOO"], env={"FOO": "bar", "PATH": "/usr/bin:/bin"})
    assert proc.stdout == "bar\n"


class FakeRun:
    def __init__(self, stdout="", returncode=0, stderr=""):
        self.calls = []
        self.result = (stdout, returncode, stderr)

    def __call__(self, argv, **kw):
        self.calls.append(list(argv))
        out, rc, err = self.result
        if kw.get("check", True) and rc != 0:
            raise SlurmCommandError(argv, rc, err)
        return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.fixture
def fake(monkeypatch):
    f = FakeRun()
    monkeypatch.setattr(commands, "run", f)
    return f


def test_show_nodes(fake):
    fake.result = ("NodeName=n1 NodeAddr=10.0.0.1 Port=6818 State=IDLE\n", 0, "")
    assert commands.show_nodes(["n1", "n2"]) == {"n1": {"NodeName": "n1", "NodeAddr": "10.0.0.1", "Port": "6818", "State": "IDLE"}}
    assert fake.calls == [["scontrol", "-o", "show", "node", "n1,n2"]]
    commands.show_nodes()
    assert fake.calls[-1] == ["scontrol", "-o", "show", "node"]
    with pytest.raises(ValueError):
        commands.show_nodes(["-x"])


def test_set_node_state(fake):
    commands.set_node_state("n3", "down", "lost heartbeat; rank 2")
    assert fake.calls == [["scontrol", "update", "nodename=n3", "state=DOWN", "reason=lost heartbeat; rank 2"]]
    with pytest.raises(ValueError):
        commands.set_node_state("n3 x", "DOWN", "r")
    with pytest.raises(ValueError):
        commands.set_node_state("n3", "EXPLODE", "r")


def test_cancel_step(fake):
    commands.cancel_step("12", "0")
    commands.cancel_step("12", "3", signal="KILL")
    assert fake.calls == [["scancel", "--ctld", "12.0"], ["scancel", "--ctld", "--signal=KILL", "12.3"]]
    with pytest.raises(ValueError):
        commands.cancel_step("12; rm", "0")
    with pytest.raises(ValueError):
        commands.cancel_step("12", "0", signal="-9 x")


def test_sbatch(fake):
    fake.result = ("77;cluster\n", 0, "")
    assert commands.sbatch("job.sh", ["--nodes=2"]) == "77"
    assert fake.calls == [["sbatch", "--parsable", "--nodes=2", "job.sh"]]


def test_job_state(fake):
    fake.result = ("RUNNING\n", 0, "")
    assert commands.job_state("5") == "RUNNING"
    assert fake.calls == [["squeue", "-h", "-j", "5", "-o", "%T"]]
    fake.result = ("", 0, "")
    assert commands.job_state("5") is None
    fake.result = ("", 1, "slurm_load_jobs error: Invalid job id specified")
    assert commands.job_state("5") is None
    fake.result = ("", 1, "Unable to contact slurm controller")
    with pytest.raises(SlurmCommandError):
        commands.job_state("5")


def test_hostnames_and_address():
    assert commands.hostnames("n[1-2]") == ["n1", "n2"]
    assert commands.node_address({"NodeName": "n1", "NodeAddr": "10.0.0.1", "Port": "17001"}) == ("10.0.0.1", 17001)
    assert commands.node_address({"NodeName": "n1"}) == ("n1", None)


HET_COMPONENT = (  # `scontrol -o show job 76` of a hetjob's worker component, after a resize
    "JobId=76 HetJobId=75 HetJobOffset=1 JobName=hetprobe HetJobIdSet=75-76 UserId=root(0) GroupId=root(0) "
    "MCS_label=N/A Priority=4294901689 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:18 "
    "TimeLimit=00:05:00 TimeMin=N/A ResizeTime=2026-11-26T00:39:07 Partition=debug AllocNode:Sid=localhost:4071 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=n[2,4-5] BatchHost=n2 NumNodes=3 NumCPUs=3 NumTasks=4 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,mem=8000M,node=4,billing=3 Socks/Node=* "
    "Command=/tmp/het probe/probe.sbatch WorkDir=/tmp/hetprobe2 Power= \n"
)


def test_show_job(fake):
    fake.result = (HET_COMPONENT, 0, "")
    job = commands.show_job("76")
    assert fake.calls == [["scontrol", "-o", "show", "job", "76"]]
    assert (job["NodeList"], job["BatchHost"], job["HetJobId"], job["HetJobOffset"]) == ("n[2,4-5]", "n2", "75", "1")
    assert job["Command"] == "/tmp/het probe/probe.sbatch" and job["Power"] == ""
    with pytest.raises(SlurmCommandError, match="no record for job 77"):
        commands.show_job("77")
    with pytest.raises(ValueError):
        commands.show_job("76 --all")


def test_set_job_nodes(fake):
    commands.set_job_nodes("76", ["n2", "n4", "n5"])
    assert fake.calls == [["scontrol", "update", "JobId=76", "NodeList=n[2,4-5]"]]
    for job_id, nodes in (("76;x", ["n2"]), ("76", []), ("76", ["n2", "-x"])):
        with pytest.raises(ValueError):
            commands.set_job_nodes(job_id, nodes)
    assert len(fake.calls) == 1
