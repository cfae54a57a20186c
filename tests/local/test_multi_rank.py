"""Tier 3, several ranks per node (G = 2): 3 worker nodes x 2 ranks + 1 spare node with
2 warm standbys, real processes and gloo on localhost. Every rank's final state is
compared (its digest) with a fault-free G = 2 run, not only rank 0's."""

import os
import signal

import pytest

from .localjob import INJECT_AFTER, LocalJob, assert_same_training, final_state, rank_digests

G = 2
# 6 ranks + 2 standbys on a 2-core box run with the default heartbeat timeout: a starved
# heartbeat thread is only a suspect (each rank's pulse vouches for it, supervisor/observe/watchdog.py).


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
    """With recovery.local_standbys the node's one standby takes local rank 1's slot."""
    job = job_factory(tasks_per_node=G, recovery={"local_standbys": True}, step_time=0.3)  # time for its import
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][3]  # local rank 1 of node index 1
    warm = job.local_standby(victim["node"])
    others = {r["rank"]: r["pid"] for r in st["ranks"] if r["rank"] != 3}
    os.kill(victim["pid"], signal.SIGKILL)  # a worker process this job started
    assert job.wait(240) == 0, job.diag()
    _same_as(job, reference_g2)
    assert _levels(job) == ["online"], job.diag()
    final = job.status()
    assert final["ranks"][3]["node"] == victim["node"] and final["ranks"][3]["pid"] != victim["pid"]
    assert (final["ranks"][3]["worker_id"], final["ranks"][3]["pid"]) == (warm["worker_id"], warm["pid"])
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


CKPT = {"local_every": 5, "shared_every_kth": 1, "shared_keep": 20, "local_keep": 20}


def _run(job):
    try:
        assert job.wait(240) == 0, job.diag()
    finally:
        job.kill_leftovers()
    return job


@pytest.mark.timeout(400)
def test_g2_scale_in_by_a_whole_node_reshards_6_to_4_exactly(tmp_path):
    """No spare: a node of 2 ranks is lost; the ZeRO-style momentum slices of all 6 ranks
    come from the newest complete checkpoint, resharded to 4 ranks; the run ends equal to
    a fresh 4-rank (2 nodes x 2) job started from the same step (the docs' definition)."""
    import shutil
    from pathlib import Path

    from slurm_resilience.checkpoint import manifest as mf
    from slurm_resilience.checkpoint.hdf5_format import shard_crc32

    from .localjob import GATHERED_RUN, STEPS, ZERO, assert_bit_identical

    a = LocalJob(tmp_path, nodes=3, spares=0, script=ZERO, checkpoint=CKPT, job_name="a", tasks_per_node=G).start()
    st = a.wait_for_step(INJECT_AFTER + 6)
    a.launcher.fail_node(st["ranks"][2]["node"])
    _run(a)
    assert _levels(a) == ["scale-in"]
    resharded = [e for e in a.events() if e["kind"] == "rank_restored" and e.get("resharded")]
    assert len(resharded) == 4 and len({e["step"] for e in resharded}) == 1, resharded
    step = resharded[0]["step"]
    assert a.status()["tasks_per_node"] == G and len(a.status()["ranks"]) == 4

    dst = tmp_path / "b" / "checkpoints"
    shards = {}
    for r in range(3 * G):  # rank r ran on local{r // G + 1}
        src = mf.shard_path(str(tmp_path / "local" / f"local{r // G + 1}" / "ckpt"), step, r)
        to = mf.shard_path(str(dst), step, r)
        Path(to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, to)
        shards[r] = mf.ShardRecord(mf.shard_name(r), Path(to).stat().st_size, shard_crc32(to))
    mf.write_manifest(str(dst), mf.Manifest(step=step, world_size=3 * G, tier="L2", shards=shards,
                                            created=0.0, extra={}, run_id=GATHERED_RUN))
    mf.set_latest(str(dst), step)
    b = _run(LocalJob(tmp_path, nodes=2, spares=0, script=ZERO, checkpoint=CKPT, job_name="b",
                      local_dir=tmp_path / "local-b", tasks_per_node=G, run_id=GATHERED_RUN).start())
    assert {e["step"] for e in b.events() if e["kind"] == "rank_restored" and e.get("resharded")} == {step}
    fa, fb = final_state(a), final_state(b)
    assert fa["step"] == fb["step"] == STEPS
    assert_bit_identical(fa["objects"], fb["objects"], "objects")
    assert sorted(rank_digests(a)) == list(range(2 * G)), "a digest from every rank (two empty dicts prove nothing)"
    assert rank_digests(a) == rank_digests(b), "every rank's slice, not only rank 0's"


PARTNER = {"local_every": 5, "local_redundancy": "partner", "shared_every_kth": 0}


@pytest.fixture(scope="module")
def zero_reference_g2(tmp_path_factory):
    """Fault-free ZeRO-style run, 3 nodes x 2 ranks, partner copies (the partner test reads
    its layout). Checkpoint redundancy changes no step: the XOR test compares with it too."""
    from .localjob import ZERO

    root = tmp_path_factory.mktemp("zero-ref-g2")
    return _run(LocalJob(root, nodes=3, spares=0, script=ZERO, checkpoint=PARTNER, job_name="ref",
                         local_dir=root / "local-ref", tasks_per_node=G).start())


@pytest.mark.timeout(400)
def test_g2_xor_only_redundancy_survives_a_node_of_two_ranks(tmp_path, zero_reference_g2):
    """XOR groups never hold two ranks of one node: losing a node loses one member of
    two groups, and both slices are rebuilt from parity."""
    from .localjob import ZERO, assert_bit_identical

    ckpt = {"local_every": 5, "local_redundancy": "xor", "local_xor_group_size": 3, "shared_every_kth": 0}
    ref = zero_reference_g2
    job = LocalJob(tmp_path, nodes=3, spares=1, script=ZERO, checkpoint=ckpt, job_name="job", tasks_per_node=G).start()
    st = job.wait_for_step(INJECT_AFTER + 6)
    job.launcher.fail_node(st["ranks"][2]["node"])
    _run(job)
    assert _levels(job) == ["node-replacement"]
    rebuilt = sorted(r for e in job.events() if e["kind"] == "rank_checkpoint_rebuilt" for r in e["ranks"])
    assert rebuilt == [2, 3], [e for e in job.events() if e["kind"] == "rank_checkpoint_rebuilt"]
    races = [e for e in job.events() if e["kind"] == "rank_checkpoint_failed" and "No such file" in e["error"]]
    assert not races, races
    assert_bit_identical(final_state(job)["objects"], final_state(ref)["objects"], "objects")
    assert sorted(rank_digests(ref)) == list(range(3 * G)) and rank_digests(job) == rank_digests(ref)


@pytest.mark.timeout(400)
def test_g2_partner_only_redundancy_survives_a_node_of_two_ranks(tmp_path, zero_reference_g2):
    """PARTNER copies go to the same local rank on the next node, never to the rank's own
    node: losing a node of two ranks leaves both slices as copies on the next node."""
    from slurm_resilience.checkpoint import layout
    from slurm_resilience.checkpoint import manifest as mf

    from .localjob import ZERO, assert_bit_identical

    ckpt, ref = PARTNER, zero_reference_g2
    for k in range(3):  # node local{k+1} holds ranks 2k, 2k+1; their copies are on the next node
        root = str(ref.job_dir.parent / "local-ref" / f"local{k + 1}" / "ckpt")
        steps = mf.complete_steps(root)
        assert steps and all(sorted(mf.read_manifest(root, s).shards) == [G * k, G * k + 1] for s in steps)
        proot = layout.partner_root(root)
        prev = (k - 1) % 3
        assert mf.complete_steps(proot) == steps
        assert all(sorted(mf.read_manifest(proot, s).shards) == [G * prev, G * prev + 1] for s in steps)
    job = LocalJob(tmp_path, nodes=3, spares=1, script=ZERO, checkpoint=ckpt, job_name="job", tasks_per_node=G).start()
    st = job.wait_for_step(INJECT_AFTER + 6)
    job.launcher.fail_node(st["ranks"][2]["node"])
    _run(job)
    assert _levels(job) == ["node-replacement"]
    races = [e for e in job.events() if e["kind"] == "rank_checkpoint_failed" and "No such file" in e["error"]]
    assert not races, races  # node-mates never delete what the other one is pruning or still needs
    assert_bit_identical(final_state(job)["objects"], final_state(ref)["objects"], "objects")
    assert sorted(rank_digests(ref)) == list(range(3 * G)) and rank_digests(job) == rank_digests(ref)
