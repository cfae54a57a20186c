"""Where the supervisor puts ranks (pure): plain allocation vs heterogeneous job."""

import pytest

from slurm_resilience.errors import ResilienceError
from slurm_resilience.launch.allocation import WORKER_HET_GROUP, WorkerPool, worker_pool
from slurm_resilience.slurm.parse import SlurmEnv

HETJOB_ENV = {  # the batch step of a hetjob: component 0 = n1 (supervisor), 1 = n[2-5]
    "SLURM_JOB_ID": "40", "SLURM_JOB_NODELIST": "n1", "SLURMD_NODENAME": "n1", "SLURM_HET_SIZE": "2",
    "SLURM_JOB_ID_HET_GROUP_0": "40", "SLURM_JOB_ID_HET_GROUP_1": "41",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-5]",
}
PLAIN = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-6]", "SLURMD_NODENAME": "n1"}


def test_plain_allocation_leaves_out_the_supervisor_node():
    assert worker_pool(SlurmEnv.from_environ(PLAIN), supervisor_node=True) == \
        WorkerPool(("n2", "n3", "n4", "n5", "n6"), None)
    assert worker_pool(SlurmEnv.from_environ(PLAIN), supervisor_node=False).nodes == \
        ("n1", "n2", "n3", "n4", "n5", "n6")


@pytest.mark.parametrize("supervisor_node", [True, False])
def test_hetjob_takes_workers_from_component_1(supervisor_node):
    pool = worker_pool(SlurmEnv.from_environ(HETJOB_ENV), supervisor_node)
    assert pool == WorkerPool(("n2", "n3", "n4", "n5"), WORKER_HET_GROUP, "41") and WORKER_HET_GROUP == 1


def test_hetjob_with_one_component_is_an_error():
    env = {"SLURM_JOB_ID": "40", "SLURMD_NODENAME": "n1", "SLURM_HET_SIZE": "1",
           "SLURM_JOB_ID_HET_GROUP_0": "40", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1"}
    with pytest.raises(ResilienceError, match="component 1"):
        worker_pool(SlurmEnv.from_environ(env), supervisor_node=True)
