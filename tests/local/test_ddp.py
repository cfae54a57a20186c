"""Tier 3: an ordinary DDP script (examples/train_ddp.py: DataLoader workers, AMP
GradScaler, LR scheduler, gradient accumulation with no_sync, eval with dist.all_reduce)
under the real Supervisor on localhost, 3 ranks (gloo's ring all-reduce order matters
from 3 ranks on). Faults land inside DDP's own bucket all-reduce or the user's
dist.all_reduce; every rank's final state must equal the fault-free run's, and the
same script under plain torchrun must give the fault-free result too."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import shard_crc32

from .localjob import GATHERED_RUN, LocalJob, rank_digests

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ddp.py"
STEPS = 30
RANKS = 3
SLOW_BOX = {"heartbeat_timeout_s": 8, "standby_heartbeat_timeout_s": 16}  # 2-core box: see test_multi_rank


def _job(root, **kw) -> LocalJob:
    kw.setdefault("detect", SLOW_BOX)
    kw.setdefault("step_time", 0.1)
    return LocalJob(root, nodes=RANKS, steps=STEPS, script=SCRIPT, **kw).start()


def _finals(out: Path) -> dict[int, dict]:
    return {r: torch.load(out / f"final-rank{r}.pt", weights_only=False) for r in range(RANKS)}


def _equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


EVERY_STEP_KEPT = {"local_every": 1, "local_keep": STEPS + 1, "shared_every_kth": 0}  # L1: each step's state


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """Fault-free: every rank's final state and digest, and where its L1 checkpoint of
    every step lies (a fresh job can start from any step of the fault-free run)."""
    root = tmp_path_factory.mktemp("ddp-reference")
    job = _job(root, checkpoint=EVERY_STEP_KEPT)
    try:
        assert job.wait(240) == 0, job.diag()
        assert not any(e["kind"] == "fault_detected" for e in job.events()), job.diag()
        finals = _finals(job.job_dir)
        assert all(f["step"] == STEPS for f in finals.values())
        assert finals[0]["optimizer"]["state"] and finals[0]["scaler"]["scale"] > 0
        for r in range(1, RANKS):  # DDP keeps the replicas equal
            _equal(finals[r]["model"], finals[0]["model"], f"rank {r} model")
        return finals, rank_digests(job), root / "local" / "local1" / "ckpt"  # rank 0 ran on local1
    finally:
        job.kill_leftovers()


def _same_as_reference(job, reference):
    finals, digests, _ = reference
    got = _finals(job.job_dir)
    for r in range(RANKS):
        _equal(got[r], finals[r], f"rank {r}")
    assert sorted(digests) == list(range(RANKS)) and rank_digests(job) == digests, "every rank's done digest"


def _logged_steps(job) -> list[str]:
    log = (job.job_dir / "logs")
    lines = []
    for p in sorted(log.glob("*.log")):
        lines += [ln for ln in p.read_text().splitlines() if ln.startswith(("step ", "after step "))]
    return lines


@pytest.mark.timeout(300)
def test_ddp_rank_killed_recovers_bit_identical(tmp_path, ddp_reference):
    job = _job(tmp_path)
    try:
        st = job.wait_for_step(8)
        os.kill(st["ranks"][2]["pid"], signal.SIGKILL)  # its peers are inside DDP's all-reduce or between steps
        assert job.wait(240) == 0, job.diag()
        assert [e["level"] for e in job.events() if e["kind"] == "recovery_done"] == ["online"], job.diag()
        _same_as_reference(job, ddp_reference)
        lines = _logged_steps(job)
        assert len(lines) == len(set(lines)), "rank 0 logged no step twice"
    finally:
        job.kill_leftovers()


@pytest.mark.timeout(300)
def test_ddp_node_lost_recovers_on_spare_bit_identical(tmp_path, ddp_reference):
    job = _job(tmp_path)
    try:
        st = job.wait_for_step(8)
        job.launcher.fail_node(st["ranks"][1]["node"])
        assert job.wait(240) == 0, job.diag()
        assert [e["level"] for e in job.events() if e["kind"] == "recovery_done"] == ["node-replacement"], job.diag()
        _same_as_reference(job, ddp_reference)
    finally:
        job.kill_leftovers()


@pytest.mark.timeout(300)
def test_same_script_under_plain_torchrun_gives_the_fault_free_result(tmp_path, ddp_reference):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SR_")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(RANKS), str(SCRIPT), "--steps", str(STEPS), "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "running unsupervised (torchrun" in run.stderr
    finals = ddp_reference[0]
    got = _finals(tmp_path)
    for r in range(RANKS):
        _equal(got[r], finals[r], f"rank {r}")


def _bucket_experiment(tmp_path, mode: str) -> set[str]:
    store = tmp_path / f"store-{mode}"
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("ddp_buckets.py")), str(r), "3",
                               str(store), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return {o[0].strip() for o in outs}


@pytest.mark.timeout(300)
def test_a_ddp_rebuilt_mid_run_reduces_differently_unless_its_buckets_are_static(tmp_path):
    """Why session.ddp fixes the bucket layout: with 3 ranks, torch's default DDP rebuilt
    at step 4 (first iteration: one bucket in parameter order) sums the gradients in another
    order than the run's own DDP (re-bucketed by gradient-ready order) and the weights
    differ; with static_buckets both runs end bit-identical."""
    assert _bucket_experiment(tmp_path, "default") == {"different"}
    assert _bucket_experiment(tmp_path, "static") == {"identical"}


@pytest.mark.timeout(300)
def test_the_plain_ddp_version_runs_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SR_")}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPT.with_name("train_ddp_plain.py")), "--steps", "12", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"final-rank{r}.pt", weights_only=False) for r in range(2))
    _equal(a["model"], b["model"], "replicas")


def _fresh_job_from(tmp_path, src_shard: Path, step: int, world: int, nodes: int) -> LocalJob:
    """A fresh ``nodes``-rank job whose only checkpoint is ``src_shard`` (replicated state:
    one shard restores every rank), committed as step ``step`` of its shared tier."""
    assert src_shard.exists(), f"no L1 checkpoint of step {step}: {src_shard}"
    dst = tmp_path / "fresh" / "checkpoints"
    to = Path(mf.shard_path(str(dst), step, 0))
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src_shard, to)
    mf.write_manifest(str(dst), mf.Manifest(step=step, world_size=world, tier="L2", created=0.0, extra={},
                                            shards={0: mf.ShardRecord(mf.shard_name(0), to.stat().st_size,
                                                                      shard_crc32(str(to)))},
                                            run_id=GATHERED_RUN))  # a checkpoint is restored by its own run only
    mf.set_latest(str(dst), step)
    return LocalJob(tmp_path, nodes=nodes, spares=0, steps=STEPS, step_time=0.1, script=SCRIPT, detect=SLOW_BOX,
                    job_name="fresh", local_dir=tmp_path / "local-fresh", run_id=GATHERED_RUN).start()


@pytest.mark.timeout(400)
def test_ddp_scale_in_continues_at_the_exact_data_position(tmp_path, ddp_reference):
    """No spare: a node is lost and the survivors continue at world 2 from step k (their
    live state). The data continue at k's global sample position, and the run ends equal,
    on every rank, to a fresh 2-rank job started from step k (the docs' definition of
    identical after a world-size change, docs/determinism.md). Step k's checkpoint comes
    from the fault-free run: the faulty run's own L1 commit of step k is collective and
    usually dies with the lost node; its state at k is the fault-free run's (no fault yet)."""
    job = LocalJob(tmp_path, nodes=RANKS, spares=0, steps=STEPS, step_time=0.1, script=SCRIPT, detect=SLOW_BOX).start()
    try:
        st = job.wait_for_step(8)
        job.launcher.fail_node(st["ranks"][1]["node"])
        assert job.wait(240) == 0, job.diag()
        assert [e["level"] for e in job.events() if e["kind"] == "recovery_done"] == ["scale-in"], job.diag()
        restored = [e for e in job.events() if e["kind"] == "rank_restored" and e["generation"] == 1]
        k = restored[0]["step"]
        per_step = 16  # --batch: samples per rank per step
        assert {e["position"] for e in restored} == {k * RANKS * per_step}
        final = torch.load(job.job_dir / "final.pt", weights_only=False)
        assert final["step"] == STEPS and final["position"] == k * RANKS * per_step + (STEPS - k) * 2 * per_step
        # every global sample position consumed exactly once: the loader restarted at k's position
        finals = {r: torch.load(job.job_dir / f"final-rank{r}.pt", weights_only=False) for r in range(2)}
        _equal(finals[0]["model"], finals[1]["model"], "replicas after scale-in")
    finally:
        job.kill_leftovers()

    fresh = _fresh_job_from(tmp_path, Path(mf.shard_path(str(ddp_reference[2]), k, 0)), k, RANKS, nodes=2)
    try:
        assert fresh.wait(240) == 0, fresh.diag()
    finally:
        fresh.kill_leftovers()
    started = [e for e in fresh.events() if e["kind"] == "rank_restored" and e["generation"] == 0]
    assert {(e["step"], e["position"]) for e in started} == {(k, k * RANKS * per_step)}, started
    assert not [e for e in fresh.events() if e["kind"] == "fault_detected"], fresh.diag()
    for r in range(2):
        _equal(torch.load(fresh.job_dir / f"final-rank{r}.pt", weights_only=False), finals[r], f"rank {r}")
    assert sorted(rank_digests(job)) == [0, 1] and rank_digests(fresh) == rank_digests(job), "every rank's done digest"
    _equal(torch.load(fresh.job_dir / "final.pt", weights_only=False)["objects"], final["objects"], "final.pt")


@pytest.mark.timeout(300)
def test_ddp_relaunch_from_checkpoint_marks_redone_steps_as_replays(tmp_path, ddp_reference):
    """Online recovery given no time: every rank is relaunched and restores step 10 from
    the checkpoint tiers while the job had passed step 13. Steps 10.. are redone: the
    result is still bit-identical, and the logger logs no step twice (step.replay).
    recovery.local_standbys: each node's warm standby takes that node's slot in the
    relaunch (no torch import), the former spare's included: the spare kept one extra
    standby that became its own when it took the lost node's rank, so no rank starts cold."""
    job = _job(tmp_path, checkpoint={"shared_every_kth": 1},
               recovery={"online_timeout_s": 0.005, "local_standbys": True},
               step_time=0.3)  # the standbys start at the first step: time for their import
    try:
        st = job.wait_for_step(13)
        lost = st["ranks"][1]["node"]
        spare = st["spares"][0]["node"]
        warm = {n: job.local_standby(n)["worker_id"] for n in (st["ranks"][0]["node"], spare, st["ranks"][2]["node"])}
        job.launcher.fail_node(lost)  # forces a relaunch that restores from disk
        assert job.wait(240) == 0, job.diag()
        assert [e["level"] for e in job.events() if e["kind"] == "recovery_done"] == ["process-restart"], job.diag()
        relaunch = max(e["generation"] for e in job.events() if e["kind"] == "recovery_done")
        adopted = {e["node"]: e["worker_id"] for e in job.events()
                   if e["kind"] == "local_standby_adopted" and e["generation"] == relaunch}
        assert adopted == warm, job.diag()  # all 3 slots warm: no process started for the relaunch
        restored = {e["step"] for e in job.events() if e["kind"] == "rank_restored" and e["generation"] > 0}
        assert restored and max(restored) < 13, restored  # a real rollback
        _same_as_reference(job, ddp_reference)
        lines = _logged_steps(job)
        assert "step 10 loss" in " ".join(lines) and len(lines) == len(set(lines)), lines
        assert (job.job_dir / "high_water").read_text().strip() == str(STEPS)
    finally:
        job.kill_leftovers()
