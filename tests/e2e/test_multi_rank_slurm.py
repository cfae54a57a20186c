"""End to end on the real local Slurm with several ranks per node (G = 2): 4 worker
nodes x 2 ranks + 1 spare node holding 2 warm standbys. Every rank's final state is
compared (its digest, from its ``rank_done`` event), not only rank 0's ``final.pt``."""

import os
import shutil
import time
import signal

import pytest
import torch

from slurm_resilience import lab
from slurm_resilience.checkpoint import layout
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.events import read_events

from .conftest import FAULT_STEP_TIME, STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]

G = 2
KILL_AT = 12
# 4 nodes x 2 ranks + 2 standbys + the supervisor: 11 torch processes on this 2-core box.
# With the 2 s default a rank's heartbeat thread, starved of the CPU (and the GIL), was
# declared hung in CI while healthy (a false alarm the toolkit does not yet tell from a
# real hang: issue "Faults as clusters really have them"). These tests are about where
# ranks go, not about detection speed, so they give heartbeats 8 s on this box.
DETECT = "detect:\n  heartbeat_timeout_s: 8\n  standby_heartbeat_timeout_s: 16\n"


def _cfg(tmp_path, name, text=None):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text((text if text is not None else lab.LOCAL_CONFIG.read_text()) + DETECT)
    return cfg


def _events(job_dir, kind=None):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if kind is None or e["kind"] == kind]


def _levels(run):
    return [e["level"] for e in _events(run.job_dir, "recovery_done")]


@pytest.fixture(scope="module")
def reference_g2(slurm_cluster, jobs_root, tmp_path_factory):
    lab.cluster("reset")
    run = lab.submit(jobs_root / "reference-g2", tasks_per_node=G, steps=STEPS,
                     config=_cfg(tmp_path_factory.mktemp("g2"), "g2"))
    assert run.wait() == 0, run.output()
    digests = lab.rank_digests(run.job_dir)
    assert sorted(digests) == list(range(4 * G)), digests
    assert not _events(run.job_dir, "recovery_start")
    table = _events(run.job_dir, "plan")[0]
    assert len(table["nodes"]) == 8 and len(set(table["nodes"])) == 4  # two ranks on each node
    return run.job_dir / "final.pt", digests


def _same_as(run, reference):
    final, digests = reference
    assert lab.compare_runs(final, run.job_dir / "final.pt") == []
    assert lab.rank_digests(run.job_dir) == digests


def test_g2_node_cut_from_the_supervisor_finishes_on_the_spare_bit_identical(cluster, jobs_root, reference_g2,
                                                                             tmp_path):
    """The node of ranks 2 and 3 can no longer reach the supervisor's store and liveness
    ports, nor they it (``partition-supervisor``); its peers and slurmctld still reach
    it. The supervisor cannot steer ranks it cannot reach: the node is lost to the job,
    replaced by the spare, its steps ended through Slurm; the survivors keep their
    processes; bit-identical. (A killed node at G = 2: the scale-in test below.)"""
    run = lab.submit(jobs_root / "g2-node-cut", tasks_per_node=G, steps=STEPS, config=_cfg(tmp_path, "g2"),
                     step_time=FAULT_STEP_TIME)
    st = run.wait_for_step(KILL_AT)
    victim = st["ranks"][2]["node"]  # ranks 2 and 3
    spare = st["spares"][0]["node"]
    survivors = {r["rank"]: r["pid"] for r in st["ranks"] if r["node"] != victim}
    ep = st["endpoints"]
    ports = ",".join(str(p) for p in (ep.get("store_port"), ep.get("liveness_port")) if p)
    try:
        lab.net_fault("partition-supervisor", victim, "--supervisor-addr", ep["host"], "--ports", ports)
        assert run.wait() == 0, run.output()
    finally:
        lab.net_fault("heal")
        lab.cluster("revive-node", victim, timeout=60)
    _same_as(run, reference_g2)
    assert _levels(run) == ["node-replacement"]
    lost = [e["fault"] for e in _events(run.job_dir, "fault_detected")]
    assert lost and {f["node"] for f in lost} == {victim}, lost
    assert _events(run.job_dir, "plan")[-1]["nodes"][2:4] == [spare, spare]
    final = run.status
    assert {r["rank"]: r["pid"] for r in final["ranks"] if r["rank"] in survivors} == survivors


def test_g2_one_local_rank_killed_only_it_restarts(cluster, jobs_root, reference_g2, tmp_path):
    run = lab.submit(jobs_root / "g2-rank-kill", tasks_per_node=G, steps=STEPS, config=_cfg(tmp_path, "g2"), step_time=FAULT_STEP_TIME)
    st = run.wait_for_step(KILL_AT)
    victim = st["ranks"][5]  # local rank 1 of node index 2
    others = {r["rank"]: r["pid"] for r in st["ranks"] if r["rank"] != 5}
    os.kill(victim["pid"], signal.SIGKILL)  # a process this test's job started
    assert run.wait() == 0, run.output()
    _same_as(run, reference_g2)
    assert _levels(run) == ["online"]
    final = run.status
    assert final["ranks"][5]["node"] == victim["node"] and final["ranks"][5]["pid"] != victim["pid"]
    assert {r["rank"]: r["pid"] for r in final["ranks"] if r["rank"] != 5} == others  # its node-mate kept


def test_g2_hung_local_rank_is_recovered(cluster, jobs_root, reference_g2, tmp_path):
    run = lab.submit(jobs_root / "g2-rank-hang", tasks_per_node=G, steps=STEPS, config=_cfg(tmp_path, "g2"), step_time=FAULT_STEP_TIME)
    st = run.wait_for_step(KILL_AT)
    victim = st["ranks"][6]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        assert run.wait() == 0, run.output()
    finally:
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass  # it was killed by the recovery
    _same_as(run, reference_g2)
    assert _levels(run) == ["online"]
    assert any(e["fault"]["kind"] == "process_hung" for e in _events(run.job_dir, "fault_detected"))


def test_g2_no_spare_scales_in_by_a_node_and_reshards_8_to_6(cluster, jobs_root, tmp_path):
    """A: 4 nodes x 2 ranks, no spare, ZeRO-style sharded momentum; a node is lost: the
    world shrinks by G and every slice comes from the newest complete L2 checkpoint,
    resharded 8 -> 6. B: a fresh 3-node job started from that same L2 checkpoint.
    They must end bit-identical (the docs' definition at a changed world size)."""
    cfg = _cfg(tmp_path, "zero", lab.LOCAL_CONFIG.read_text().replace("shared_every_kth: 2", "shared_every_kth: 1")
               .replace("local_every: 10", "local_every: 5") + "  shared_keep: 20\n")  # B starts from A's step
    # 0.5 s steps: 2.5 s between two checkpoints, so the kill below lands between them even
    # when the events that tell the test where the job is arrive late on a loaded box
    a = lab.submit(jobs_root / "g2-scale-in-a", spares=0, tasks_per_node=G, steps=STEPS, config=cfg,
                   script=lab.ZERO_EXAMPLE, step_time=0.5)
    st = a.wait_for_step(11)
    # Kill once step 10 is in L2 on every rank and well before step 15's checkpoint (4
    # slow steps away): a kill during a checkpoint's L2 flush leaves that step in L1 only,
    # and B is started from A's L2 step directory.
    # On a loaded box step 10's L2 may be durable only once step 15's checkpoint began:
    # then wait for step 15 in L2 instead (and so on), and kill between two checkpoints.
    target = 10
    while True:
        deadline = time.time() + 60
        while len({e["rank"] for e in _events(a.job_dir, "rank_checkpoint_durable")
                   if e.get("step") == target and e.get("tier") == "L2"}) < 8:
            assert time.time() < deadline, f"step {target} never reached L2 on every rank"
            time.sleep(0.05)
        if not any(e.get("step") == target + 5 for e in _events(a.job_dir, "rank_checkpoint_saved")):
            break  # the next checkpoint has not begun
        target += 5
        assert target + 5 < STEPS, "the job outran every window between two checkpoints"
    lab.kill_node(st["ranks"][2]["node"])
    assert a.wait() == 0, a.output()
    assert _levels(a) == ["scale-in"]
    resharded = [e for e in _events(a.job_dir, "rank_restored") if e.get("resharded") and e["generation"] > 0]
    assert len(resharded) == 6 and len({e["step"] for e in resharded}) == 1, resharded
    step = resharded[0]["step"]
    assert step >= 5 and a.status["tasks_per_node"] == G and len(a.status["ranks"]) == 6

    b_dir = jobs_root / "g2-scale-in-b"
    src, dst = layout.job_checkpoints(str(a.job_dir)), layout.job_checkpoints(str(b_dir))
    shutil.copytree(layout.step_dir(src, step), layout.step_dir(dst, step))
    mf.set_latest(dst, step)
    # B continues A's run (a resubmission by hand at another size): A's checkpoints are its own
    b = lab.submit(b_dir, nodes=3, spares=0, tasks_per_node=G, steps=STEPS, config=cfg, script=lab.ZERO_EXAMPLE,
                   cli_args=["--continue-run", str(a.job_dir)])
    assert b.wait() == 0, b.output()
    assert {e["step"] for e in _events(b.job_dir, "rank_restored") if e.get("resharded")} == {step}
    assert lab.compare_runs(a.job_dir / "final.pt", b.job_dir / "final.pt") == []
    assert lab.rank_digests(a.job_dir) == lab.rank_digests(b.job_dir)  # every rank's slice
    assert torch.load(a.job_dir / "final.pt", weights_only=False)["step"] == STEPS


def test_g2_xor_only_redundancy_with_a_node_lost(cluster, jobs_root, tmp_path):
    """No partner copy, no shared tier: the node of ranks 2 and 3 is cut from everyone
    (``partition-node``; its processes keep running), and its two momentum slices are
    rebuilt from XOR parity on the survivors and the spare (groups never hold two ranks
    of one node); bit-identical."""
    cfg = _cfg(tmp_path, "xor", lab.LOCAL_CONFIG.read_text().replace("shared_every_kth: 2", "shared_every_kth: 0")
               .replace("local_every: 10", "local_every: 5")
               + "  local_redundancy: xor\n  local_xor_group_size: 4\n")
    ref = lab.submit(jobs_root / "g2-xor-ref", tasks_per_node=G, steps=STEPS, config=cfg, script=lab.ZERO_EXAMPLE)
    assert ref.wait() == 0, ref.output()
    run = lab.submit(jobs_root / "g2-xor", tasks_per_node=G, steps=STEPS, config=cfg, script=lab.ZERO_EXAMPLE, step_time=FAULT_STEP_TIME)
    st = run.wait_for_step(KILL_AT)
    victim = st["ranks"][2]["node"]
    try:  # cut from everyone (no FIN, no RST): the XOR rebuild must not wait on it
        lab.net_fault("partition-node", victim)
        deadline = time.time() + 120
        while not _events(run.job_dir, "recovery_done"):  # recovered while the node is still cut off
            assert run.process.poll() is None and time.time() < deadline, run.output()
            time.sleep(0.1)
        # healed now, not at the job's end: a survivor's abandoned all-reduce with the cut node
        # would otherwise hold its process's exit until the group's time-out (30 s)
        lab.net_fault("heal")
        assert run.wait() == 0, run.output()
    finally:
        lab.net_fault("heal")
        lab.cluster("revive-node", victim, timeout=60)
    assert _levels(run) == ["node-replacement"]
    # nothing waited on the cut node: an exchange it cut off runs on in gloo until the group's
    # timeout (reconnect.pg_timeout_s, 30 s), and the recovery must not wait for that
    (start,), (done,) = _events(run.job_dir, "recovery_start"), _events(run.job_dir, "recovery_done")
    assert done["t"] - start["t"] < 15, f"recovery took {done['t'] - start['t']:.1f} s"
    rebuilt = sorted(r for e in _events(run.job_dir, "rank_checkpoint_rebuilt") for r in e["ranks"])
    assert rebuilt == [2, 3], _events(run.job_dir, "rank_checkpoint_rebuilt")
    assert lab.compare_runs(ref.job_dir / "final.pt", run.job_dir / "final.pt") == []
    assert lab.rank_digests(run.job_dir) == lab.rank_digests(ref.job_dir)
