"""Tier 3: an ordinary DDP script (examples/train_ddp.py: DataLoader workers, AMP
GradScaler, LR scheduler, gradient accumulation with no_sync, eval with dist.all_reduce)
under the real Supervisor on localhost, 3 ranks (gloo's ring all-reduce order matters
from 3 ranks on). Faults land inside DDP's own bucket all-reduce or the user's
dist.all_reduce; every rank's final state must equal the fault-free run's, and the
same script under plain torchrun must give the fault-free result too."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .localjob import LocalJob, rank_digests

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ddp.py"
STEPS = 30
RANKS = 3
SLOW_BOX = {"heartbeat_timeout_s": 8, "standby_heartbeat_timeout_s": 16}  # 2-core box: see test_multi_rank


def _job(root, **kw) -> LocalJob:
    kw.setdefault("detect", SLOW_BOX)
    return LocalJob(root, nodes=RANKS, steps=STEPS, step_time=0.1, script=SCRIPT, **kw).start()


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


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("ddp-reference"))
    try:
        assert job.wait(240) == 0, job.diag()
        assert not any(e["kind"] == "fault_detected" for e in job.events()), job.diag()
        finals = _finals(job.job_dir)
        assert all(f["step"] == STEPS for f in finals.values())
        assert finals[0]["optimizer"]["state"] and finals[0]["scaler"]["scale"] > 0
        for r in range(1, RANKS):  # DDP keeps the replicas equal
            _equal(finals[r]["model"], finals[0]["model"], f"rank {r} model")
        return finals, rank_digests(job)
    finally:
        job.kill_leftovers()


def _same_as_reference(job, reference):
    finals, digests = reference
    got = _finals(job.job_dir)
    for r in range(RANKS):
        _equal(got[r], finals[r], f"rank {r}")
    assert rank_digests(job) == digests, "every rank's done digest"


def _logged_steps(job) -> list[str]:
    log = (job.job_dir / "logs")
    lines = []
    for p in sorted(log.glob("*.log")):
        lines += [ln for ln in p.read_text().splitlines() if ln.startswith("step ")]
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
    finals, _ = ddp_reference
    got = _finals(tmp_path)
    for r in range(RANKS):
        _equal(got[r], finals[r], f"rank {r}")
