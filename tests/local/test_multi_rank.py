"""Tier 3, several ranks per node (G = 2): 3 worker nodes x 2 ranks + 1 spare node with
2 warm standbys, real processes and gloo on localhost. Every rank's final state is
compared (its digest) with a fault-free G = 2 run, not only rank 0's."""

import os
import signal

import pytest

from .localjob import INJECT_AFTER, LocalJob, assert_same_training, final_state, rank_digests

G = 2


@pytest.fixture(scope="module")
def reference_g2(tmp_path_factory):
    job = LocalJob(tmp_path_factory.mktemp("reference-g2"), tasks_per_node=G).start()
    try:
        assert job.wait(240) == 0, job.diag()
        digests = rank_digests(job)
        assert sorted(digests) == list(range(3 * G)), job.diag()
        return final_state(job), digests
    finally:
        job.kill_leftovers()


def _same_as(job, reference):
    state, digests = reference
    assert_same_training(final_state(job), state)
    assert rank_digests(job) == digests, "every rank's final state"


def _levels(job):
    return [e["level"] for e in job.events() if e["kind"] == "recovery_done"]


@pytest.mark.timeout(300)
def test_g2_node_loss_moves_both_ranks_to_the_spare(job_factory, reference_g2):
    job = job_factory(tasks_per_node=G)
    st = job.wait_for_step(INJECT_AFTER)
    lost = st["ranks"][2]["node"]  # node index 1 holds ranks 2 and 3
    survivors = {r["rank"]: r["pid"] for r in st["ranks"] if r["node"] != lost}
    job.launcher.fail_node(lost)
    assert job.wait(240) == 0, job.diag()
    _same_as(job, reference_g2)
    assert _levels(job) == ["node-replacement"], job.diag()
    final = job.status()
    assert {r["node"] for r in final["ranks"][2:4]} == {st["spares"][0]["node"]}
    assert {r["rank"]: r["pid"] for r in final["ranks"] if r["rank"] in survivors} == survivors


@pytest.mark.timeout(300)
def test_g2_one_local_rank_killed_only_it_restarts(job_factory, reference_g2):
    job = job_factory(tasks_per_node=G)
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][3]  # local rank 1 of node index 1
    others = {r["rank"]: r["pid"] for r in st["ranks"] if r["rank"] != 3}
    os.kill(victim["pid"], signal.SIGKILL)  # a worker process this job started
    assert job.wait(240) == 0, job.diag()
    _same_as(job, reference_g2)
    assert _levels(job) == ["online"], job.diag()
    final = job.status()
    assert final["ranks"][3]["node"] == victim["node"] and final["ranks"][3]["pid"] != victim["pid"]
    assert {r["rank"]: r["pid"] for r in final["ranks"] if r["rank"] != 3} == others  # its node-mate too


@pytest.mark.timeout(300)
def test_g2_hung_local_rank_is_recovered(job_factory, reference_g2):
    job = job_factory(tasks_per_node=G)
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][1]
    os.kill(victim["pid"], signal.SIGSTOP)  # hung: the process stays, its heartbeat stops
    try:
        assert job.wait(240) == 0, job.diag()
    finally:
        os.kill(victim["pid"], signal.SIGCONT) if os.path.exists(f"/proc/{victim['pid']}") else None
    _same_as(job, reference_g2)
    assert _levels(job) == ["online"], job.diag()
