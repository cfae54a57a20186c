"""scripts/local-cluster's kill-node finds a node's processes from /proc/PID/cgroup:
those in Slurm's freezer cgroups of the node or in the node's own cgroup v2."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
_loader = importlib.machinery.SourceFileLoader("local_cluster", str(SCRIPTS / "local-cluster"))
_spec = importlib.util.spec_from_loader("local_cluster", _loader)
lc = importlib.util.module_from_spec(_spec)
_loader.exec_module(lc)

# /proc/PID/cgroup of processes on a cgroup v1 box with the v2 hierarchy beside it
STEP_TASK = """12:pids:/
5:freezer:/slurm_n1/uid_0/job_712/step_0/task_0
1:name=systemd:/
0::/sr-lab/n1
"""
SLURMD = "5:freezer:/\n0::/sr-lab/n1\n"
OTHER_NODE = "5:freezer:/slurm_n10/uid_0/job_9/step_batch\n0::/sr-lab/n10\n"
OLD_STEPD = "5:freezer:/slurm_n1\n0::/\n"  # a stepd started before the node had a v2 cgroup
UNRELATED = "5:freezer:/\n0::/user.slice\n"


def test_a_node_owns_its_job_cgroups_and_its_v2_cgroup_and_nothing_else():
    assert lc.in_node_cgroup(STEP_TASK, "n1") and lc.in_node_cgroup(SLURMD, "n1")
    assert lc.in_node_cgroup(OLD_STEPD, "n1")
    assert not lc.in_node_cgroup(OTHER_NODE, "n1")  # n10 is not n1
    assert lc.in_node_cgroup(OTHER_NODE, "n10")
    assert not lc.in_node_cgroup(UNRELATED, "n1") and not lc.in_node_cgroup("", "n1")
