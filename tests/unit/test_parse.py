import pytest
from hypothesis import given, settings, strategies as st

from slurm_resilience.slurm.parse import (
    SlurmEnv,
    compress_hostlist,
    expand_hostlist,
    node_state_flags,
    parse_sbatch_job_id,
    parse_scontrol_nodes,
    validate_node_name,
)


@pytest.mark.parametrize(
    "s,want",
    [
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("  n1 ", ["n1"]),
        ("", []),
        ("n[7]", ["n7"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("x[1-2]y", ["x1y", "x2y"]),
        ("localhost", ["localhost"]),
    ],
)
def test_expand(s, want):
    assert expand_hostlist(s) == want


@pytest.mark.parametrize("s", ["n[1-3", "n1-3]", "n[5-3]", "n[a-b]", "n[]", "n[1-]", "a,,b", "n[[1]]", ","])
def test_expand_malformed(s):
    with pytest.raises(ValueError):
        expand_hostlist(s)


def test_compress():
    assert compress_hostlist(["n1", "n2", "n3", "n5"]) == "n[1-3,5]"
    assert compress_hostlist(["gpu01", "gpu02", "x"]) == "gpu[01-02],x"
    assert compress_hostlist(["n1"]) == "n1"
    assert compress_hostlist([]) == ""


name = st.builds(
    lambda p, n, w: p + str(n).zfill(w),
    st.sampled_from(["n", "gpu", "a-b", "r1-n", ""]),
    st.integers(0, 120),
    st.integers(0, 3),
) | st.sampled_from(["localhost", "head", "x.y"])


@settings(max_examples=300, deadline=None)
@given(st.lists(name, max_size=20))
def test_roundtrip(names):
    assert expand_hostlist(compress_hostlist(names)) == names


SCONTROL = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.00 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=localhost "
    "Port=17001 Version=22.05.8 OS=Linux 6.1.0 #1 SMP RealMemory=2000 AllocMem=0 FreeMem=N/A Sockets=2 "
    "Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug "
    "BootTime=2026-11-25T23:40:01 SlurmdStartTime=2026-11-25T23:40:01 LastBusyTime=2026-11-25T23:40:01 "
    "CfgTRES=cpu=2,mem=2000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
    "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s Reason=Not responding [slurm@2026-11-25T23:41:00]\n"
    "NodeName=n2 NodeAddr=127.0.0.2 Port=17002 State=DOWN* OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC Weight=1 "
    "Reason=killed: Key=Value inside reason [root@2026]\n"
    "\n"
    "NodeName=n3 NodeAddr=127.0.0.3 State=ALLOCATED+DRAIN AllocTRES=\n"
)


def test_parse_scontrol():
    nodes = parse_scontrol_nodes(SCONTROL)
    assert list(nodes) == ["n1", "n2", "n3"]
    n1 = nodes["n1"]
    assert n1["OS"] == "Linux 6.1.0 #1 SMP"
    assert n1["Reason"] == "Not responding [slurm@2026-11-25T23:41:00]"
    assert n1["CfgTRES"] == "cpu=2,mem=2000M,billing=2"
    assert n1["AllocTRES"] == "" and n1["State"] == "IDLE" and n1["Port"] == "17001"
    assert n1["MCS_label"] == "N/A"
    assert nodes["n2"]["Reason"] == "killed: Key=Value inside reason [root@2026]"
    assert nodes["n2"]["OS"] == "Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC"
    assert nodes["n3"] == {"NodeName": "n3", "NodeAddr": "127.0.0.3", "State": "ALLOCATED+DRAIN", "AllocTRES": ""}
    assert parse_scontrol_nodes("") == {}
    assert parse_scontrol_nodes("No nodes in the system\n") == {}


@pytest.mark.parametrize(
    "state,flags",
    [
        ("IDLE+DRAIN", {"IDLE", "DRAIN"}),
        ("DOWN*", {"DOWN", "NOT_RESPONDING"}),
        ("ALLOCATED", {"ALLOCATED"}),
        ("idle~", {"IDLE", "POWERED_DOWN"}),
        ("MIXED+DRAIN*", {"MIXED", "DRAIN", "NOT_RESPONDING"}),
        ("", set()),
    ],
)
def test_state_flags(state, flags):
    assert node_state_flags(state) == frozenset(flags)


def test_slurm_env():
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]", "SLURMD_NODENAME": "n2",
        "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2", "SLURM_SUBMIT_DIR": "/home/x", "OTHER": "y",
    })
    assert env == SlurmEnv(job_id="42", nodelist=("n1", "n2", "n3"), node_name="n2", step_id="0",
                           requeue_count=2, submit_dir="/home/x")
    empty = SlurmEnv.from_environ({})
    assert empty == SlurmEnv(job_id=None, nodelist=(), node_name=None, step_id=None, requeue_count=0, submit_dir=None)
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT"):
        SlurmEnv.from_environ({"SLURM_RESTART_COUNT": "x"})
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        SlurmEnv.from_environ({"SLURM_JOB_NODELIST": "n[1-"})


def test_sbatch_job_id():
    assert parse_sbatch_job_id("123\n") == "123"
    assert parse_sbatch_job_id("123;cluster\n") == "123"
    for bad in ["", "Submitted batch job", "abc;x"]:
        with pytest.raises(ValueError):
            parse_sbatch_job_id(bad)


@pytest.mark.parametrize("ok", ["n1", "gpu-01.cluster", "A_b", "x" * 63])
def test_node_name_ok(ok):
    assert validate_node_name(ok) == ok


@pytest.mark.parametrize("bad", ["", "-n1", "n1;rm", "n 1", "x" * 64, "n1\n", ".n", "n[1]", None])
def test_node_name_bad(bad):
    with pytest.raises(ValueError):
        validate_node_name(bad)


HETJOB_ENV = {  # the batch step of `sbatch hetjob.sbatch` (component 0 = n1, 1 = n[2-5])
    "SLURM_JOB_ID": "40", "SLURM_JOB_NODELIST": "n1", "SLURMD_NODENAME": "n1", "SLURM_HET_SIZE": "2",
    "SLURM_JOB_ID_HET_GROUP_0": "40", "SLURM_JOB_ID_HET_GROUP_1": "41",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-5]",
}


def test_slurm_env_hetjob():
    env = SlurmEnv.from_environ(HETJOB_ENV)
    assert env.is_hetjob and env.het_size == 2
    assert env.het_job_ids == ("40", "41")
    assert env.het_nodelists == (("n1",), ("n2", "n3", "n4", "n5"))
    assert env.job_id == "40" and env.nodelist == ("n1",)


def test_slurm_env_not_hetjob_has_no_components():
    env = SlurmEnv.from_environ({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-3]",
                                 "SLURM_JOB_NODELIST_HET_GROUP_1": "n9"})  # stray: ignored
    assert not env.is_hetjob and env.het_size == 0 and env.het_nodelists == () and env.het_job_ids == ()


@pytest.mark.parametrize("missing", ["SLURM_JOB_NODELIST_HET_GROUP_1", "SLURM_JOB_ID_HET_GROUP_0"])
def test_slurm_env_hetjob_missing_component(missing):
    env = {k: v for k, v in HETJOB_ENV.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        SlurmEnv.from_environ(env)


def test_slurm_env_hetjob_malformed():
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST_HET_GROUP_1"):
        SlurmEnv.from_environ({**HETJOB_ENV, "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-"})
    with pytest.raises(ValueError, match="SLURM_HET_SIZE"):
        SlurmEnv.from_environ({**HETJOB_ENV, "SLURM_HET_SIZE": "two"})
