"""Pure parts of the warm relaunch: messages, which commands run warm, the forked
rank's environment (equal to the cold task's, by the same rank_env), refusals, exit codes."""

import sys

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.rankenv import rank_env
from slurm_resilience.zygote_protocol import (
    AGENT_STORE_VAR, STEP_VARS, ForkRequest, Kind, Reply, decode, encode, fork_refusal, hosts_store, step_exit_code,
    task_slurm_vars, warm_entry, warm_env,
)


def _req(**kw) -> ForkRequest:
    base = dict(rank=3, local_rank=1, node_index=1, step_nodes=("n2", "n5", "n4"), tasks_per_node=2,
                step_name="sr-restart-2", master_addr="10.0.0.2", master_port=20102, restart=2,
                command=("/usr/bin/python3", "train.py", "--steps", "40"), cwd="/work", umask=0o022,
                log_path="/jobs/1/step-002.log")
    return ForkRequest(**{**base, **kw})


def test_messages_round_trip():
    req = _req()
    assert decode(encode(req)) == req
    for reply in (Reply(kind=Kind.FORKED, rank=1, pid=42), Reply(kind=Kind.EXITED, rank=1, pid=42, code=-9),
                  Reply(kind=Kind.REFUSED, rank=0, reason="why"), Reply(kind=Kind.KILLED)):
        assert decode(encode(reply)) == reply
    assert decode(encode(Kind.KILL)) is Kind.KILL


@pytest.mark.parametrize("data", [b"", b"{}", b"[1]", b'{"kind": "nope"}', b'{"kind": "fork", "rank": 1}',
                                  b'{"kind": "exited", "bogus": 1}'])
def test_bad_messages_are_value_errors(data):
    with pytest.raises(ValueError, match="not a zygote message"):
        decode(data)


def test_warm_entry():
    py = sys.executable
    which = {"python3": py, "python": py}.get
    assert warm_entry([py, "train.py", "--x", "1"], py) == ("train.py", "--x", "1")
    assert warm_entry(["python3", "t.py"], py, which=which) == ("t.py",)
    assert warm_entry([py, "-m", "pkg.train"], py) is None  # module or interpreter options: cold
    assert warm_entry([py, "-u", "t.py"], py) is None
    assert warm_entry([py], py) is None
    assert warm_entry(["/bin/sh", "t.py"], py) is None  # another program
    assert warm_entry(["nosuchpython", "t.py"], py, which=lambda _: None) is None


def test_task_slurm_vars_block_distribution():
    v = task_slurm_vars(_req(), job_nodelist="n[2,4-5]")
    assert (v["SLURM_PROCID"], v["SLURM_LOCALID"], v["SLURM_NODEID"]) == ("3", "1", "1")
    assert v["SLURM_NTASKS"] == v["SLURM_STEP_NUM_TASKS"] == "6" and v["SLURM_STEP_NUM_NODES"] == "3"
    assert v["SLURM_STEP_TASKS_PER_NODE"] == "2(x3)" and v["SLURM_GTIDS"] == "2,3"
    assert v["SLURM_JOB_NAME"] == "sr-restart-2" and v["SLURM_NTASKS_PER_NODE"] == "2"
    one = task_slurm_vars(_req(rank=0, local_rank=0, node_index=0, step_nodes=("n2",), tasks_per_node=1),
                          job_nodelist="n2")
    assert one["SLURM_STEP_TASKS_PER_NODE"] == "1" and one["SLURM_GTIDS"] == "0"


def test_warm_env_is_the_cold_task_env():
    """The zygote's step variables go; the task's come in; rank_env (the cold code) on top."""
    zygote = {"PATH": "/bin", "PYTHONPATH": "/src", "SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n5",
              "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "4", "SLURM_TASK_PID": "999",
              "SLURM_SRUN_COMM_PORT": "4242", "SR_RESTART": "0"}
    env = warm_env(zygote, _req(), job_nodelist="n[2,4-5]")
    assert env["PATH"] == "/bin" and env["PYTHONPATH"] == "/src" and env["SLURM_JOB_ID"] == "77"
    assert env["SLURMD_NODENAME"] == "n5"
    for gone in ("SLURM_STEP_ID", "SLURM_TASK_PID", "SLURM_SRUN_COMM_PORT"):
        assert gone not in env
    cold = rank_env({**task_slurm_vars(_req(), job_nodelist="n[2,4-5]")}, master_addr="10.0.0.2",
                    master_port=20102, restart=2)
    assert {k: env[k] for k in cold} == cold
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (
        "3", "1", "6", "2", "1")
    assert env["SR_RESTART"] == "2" and env["MASTER_PORT"] == "20102"
    assert set(STEP_VARS) & set(env) <= set(task_slurm_vars(_req(), job_nodelist="x"))
    # the one variable a cold task lacks: torch's env:// connects every rank to the agent store
    assert env[AGENT_STORE_VAR] == "True" and AGENT_STORE_VAR not in cold
    assert set(env) - set(zygote) - set(cold) - set(task_slurm_vars(_req(), job_nodelist="x")) == {AGENT_STORE_VAR}


def test_hosts_store_once_per_step_on_the_first_node():
    assert hosts_store(_req(node_index=0, rank=0, local_rank=0), started=False)
    assert not hosts_store(_req(node_index=0, rank=1, local_rank=1), started=True)
    assert not hosts_store(_req(), started=False)  # node_index 1: its ranks are clients only


def test_warm_env_rejects_inconsistent_request():
    with pytest.raises(ValueError, match="inconsistent"):
        warm_env({}, _req(local_rank=2), job_nodelist="n2")


def test_fork_refusal():
    assert fork_refusal(cuda_initialized=False, python_threads=1) is None
    assert "CUDA" in fork_refusal(cuda_initialized=True, python_threads=1)
    assert "3 Python threads" in fork_refusal(cuda_initialized=False, python_threads=3)


def test_step_exit_code():
    assert step_exit_code([0, 0, 0]) == 0
    assert step_exit_code([0, 3, 1]) == 3
    assert step_exit_code([0, -9]) == 137  # SIGKILL, as a shell shows it
    assert step_exit_code([]) == 0


def test_run_config_section():
    cfg = load_config({"run": {"preload": ["numpy", "transformers.models"], "warm": False}})
    assert cfg.run.preload == ("numpy", "transformers.models") and cfg.run.warm is False
    assert load_config({}).run.warm is True
    with pytest.raises(ConfigError, match="run.preload: 'num py' is not a module name"):
        load_config({"run": {"preload": ["num py"]}})
    with pytest.raises(ConfigError, match="run.preload must be a list of strings"):
        load_config({"run": {"preload": "numpy"}})
    with pytest.raises(ConfigError, match="run.zygote_start_s must be > 0"):
        load_config({"run": {"zygote_start_s": 0}})
    with pytest.raises(ConfigError, match="unknown key 'run.preloads'"):
        load_config({"run": {"preloads": []}})
