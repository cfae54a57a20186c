"""launch/rankenv: the torchrun environment of one Slurm task, with G tasks per node.

The SLURM_* values are those a real `srun -N3 -n6 --ntasks-per-node=2` task printed
on the local cluster (Slurm 22.05), inside a job allocated with 5 nodes x 2 tasks.
"""

import os
import subprocess
import sys

import pytest

from slurm_resilience.rankenv import expand_tasks_per_node, rank_env


def _task(procid: int, localid: int, nodeid: int, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
           "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
           "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NTASKS_PER_NODE": "2"}
    env.update(extra)
    return env


@pytest.mark.parametrize("spec,counts", [
    ("1", [1]), ("2(x3)", [2, 2, 2]), ("3,2(x2)", [3, 2, 2]), ("2(x2),1", [2, 2, 1]),
    ("8(x128)", [8] * 128), ("4, 4", [4, 4]),
])
def test_expand_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "x", "2(3)", "2(x)", "-1", "2(x3)(x2)"])
def test_expand_tasks_per_node_rejects(spec):
    with pytest.raises(ValueError, match="tasks-per-node list"):
        expand_tasks_per_node(spec)


def test_g2_step_every_task():
    """3 nodes x 2: RANK = 2 * GROUP_RANK + LOCAL_RANK, LOCAL_WORLD_SIZE 2, WORLD_SIZE 6."""
    seen = []
    for rank in range(6):
        env = rank_env(_task(rank, rank % 2, rank // 2), master_addr="127.0.0.1", master_port=29500, restart=1)
        assert env["WORLD_SIZE"] == "6" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500" and env["SR_RESTART"] == "1"
        seen.append((int(env["RANK"]), int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])))
    assert seen == [(r, r // 2, r % 2) for r in range(6)]


def test_step_view_wins_over_the_allocation():
    """A 1-task step inside a 2-per-node allocation: the step's counts, not the batch step's."""
    env = rank_env(_task(0, 0, 0, SLURM_NTASKS="10", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1",
                         SLURM_TASKS_PER_NODE="2(x5)", SLURM_NTASKS_PER_NODE="2"),
                   master_addr="a", master_port=1, restart=0)
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1")


def test_uneven_nodes_use_this_nodes_count():
    env = rank_env(_task(4, 1, 1, SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="3,2"),
                   master_addr="a", master_port=1, restart=0)
    assert (env["GROUP_RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "2")


def test_plain_srun_vars_only():
    """Without the STEP_* variables (older Slurm, or a wrapper): the exported counts."""
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
           "SLURM_NTASKS_PER_NODE": "2"}
    got = rank_env(env, master_addr="a", master_port=1, restart=0)
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_WORLD_SIZE"], got["GROUP_RANK"]) == ("3", "4", "2", "1")
    del env["SLURM_NTASKS_PER_NODE"]
    assert rank_env(env | {"SLURM_LOCALID": "0"}, master_addr="a", master_port=1, restart=0)["LOCAL_WORLD_SIZE"] == "1"


@pytest.mark.parametrize("change,match", [
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 of 2"),
    ({"SLURM_PROCID": "6"}, "SLURM_PROCID=6 of 6"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3"),
    ({"SLURM_PROCID": "one"}, "must be integers"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(y3)"}, "tasks-per-node list"),
])
def test_inconsistent_task_is_a_clear_error(change, match):
    with pytest.raises(ValueError, match=match):
        rank_env(_task(1, 1, 0, **change), master_addr="a", master_port=1, restart=0)


def test_main_execs_with_the_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | _task(3, 1, 1)
    code = "import os; print(*(os.environ[k] for k in ('RANK','LOCAL_RANK','LOCAL_WORLD_SIZE','GROUP_RANK','WORLD_SIZE')))"
    out = subprocess.run([sys.executable, "-m", "slurm_resilience.rankenv", "--master-addr", "h",
                          "--master-port", "7", "--", sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "1", "2", "1", "6"]


def test_main_outside_slurm_is_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "slurm_resilience.rankenv", "--master-addr", "h",
                          "--master-port", "7", "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "rankenv: error: not inside a Slurm task (missing SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, "
        "SLURM_NODEID): run under srun"]
