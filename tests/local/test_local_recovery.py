"""Tier 3: the real Supervisor and LocalLauncher on localhost, no Slurm.

Workers run examples/train_mlp.py as subprocesses (gloo on ``lo``). Faults are
injected once training has passed a step: a lost node (LocalLauncher.fail_node),
a SIGKILLed rank, and a lost node with no spare left. Recovered runs must end with
the same bits as a fault-free reference run.
"""

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from slurm_resilience.config import load_config
from slurm_resilience.launch.localhost import LocalLauncher
from slurm_resilience.supervisor.loop import Supervisor

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"
STEPS = 40
STEP_TIME = 0.1
INJECT_AFTER = 5  # fault once every rank has reported this step


class LocalJob:
    """A Supervisor in a background thread; the test is the fault injector."""

    def __init__(self, root: Path, *, nodes: int = 3, spares: int = 1) -> None:
        cfg = load_config({
            "reconnect": {"gloo_ifname": "lo"},
            "job": {"nodes": nodes, "spares": spares},
            "checkpoint": {"local_dir": str(root / "local/{node}/ckpt")},
        })
        self.job_dir = root / "job"
        self.launcher = LocalLauncher()
        self.out = io.StringIO()
        self.sup = Supervisor(
            config=cfg,
            command=[sys.executable, str(TRAIN), "--steps", str(STEPS), "--step-time", str(STEP_TIME)],
            job_dir=str(self.job_dir),
            nodes=[f"local{i}" for i in range(1, nodes + spares + 1)],
            launcher=self.launcher, store_host="127.0.0.1", job_id="test", out=self.out)
        self.code: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-supervisor", daemon=True)

    def _run(self) -> None:
        try:
            self.code = self.sup.run()
        except BaseException as exc:  # reported by wait()
            self.error = exc

    def start(self) -> "LocalJob":
        self._thread.start()
        return self

    def status(self) -> dict | None:
        try:
            return json.loads((self.job_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_for_step(self, step: int, timeout_s: float = 90.0) -> dict:
        """The status once every rank has a pid and has passed ``step``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.status()
            if st and all(r["pid"] and r["step"] >= step for r in st["ranks"]):
                return st
            if not self._thread.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"ranks did not pass step {step}: status={self.status()}\n{self.diag()}")

    def wait(self, timeout_s: float = 120.0) -> int:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"supervisor still running after {timeout_s}s\n{self.diag()}"
        if self.error is not None:
            raise self.error
        return self.code

    def events(self) -> list[dict]:
        path = self.job_dir / "events.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]

    def diag(self) -> str:
        logs = ""
        for p in sorted((self.job_dir / "logs").glob("*.log")) if (self.job_dir / "logs").exists() else []:
            logs += f"--- {p.name}\n{p.read_text()[-3000:]}\n"
        return f"--- supervisor\n{self.out.getvalue()}\n{logs}"

    def kill_leftovers(self) -> None:
        """SIGKILL, by pid, any worker this job started that is still running."""
        for step in self.launcher.steps:
            if step.process.poll() is None:
                step.process.kill()
                step.process.wait(timeout=10)


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(**kw) -> LocalJob:
        job = LocalJob(tmp_path, **kw).start()
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill_leftovers()


def _final(job: LocalJob) -> dict:
    return torch.load(job.job_dir / "final.pt", weights_only=False)


def _assert_bit_identical(a, b, where="state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_bit_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _assert_same_training(got: dict, ref: dict) -> None:
    assert got["step"] == ref["step"] == STEPS
    _assert_bit_identical(got["objects"]["model"], ref["objects"]["model"], "model")
    _assert_bit_identical(got["objects"]["optimizer"], ref["objects"]["optimizer"], "optimizer")
    assert ref["objects"]["optimizer"]["state"], "the optimizer has momentum buffers to compare"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """final.pt of a fault-free run."""
    job = LocalJob(tmp_path_factory.mktemp("reference")).start()
    try:
        code = job.wait(150)
        assert code == 0, job.diag()
        assert not any(e["kind"] == "fault_detected" for e in job.events()), job.diag()
        return _final(job)
    finally:
        job.kill_leftovers()


@pytest.mark.timeout(240)
def test_node_loss_recovers_on_spare_bit_identical(job_factory, reference):
    job = job_factory()
    st = job.wait_for_step(INJECT_AFTER)
    lost = st["ranks"][1]["node"]
    job.launcher.fail_node(lost)
    assert job.wait() == 0, job.diag()
    _assert_same_training(_final(job), reference)
    events = job.events()
    done = [e for e in events if e["kind"] == "recovery_done"]
    assert done and done[0]["level"] == "node-replacement", job.diag()
    final_status = job.status()
    assert lost not in [r["node"] for r in final_status["ranks"]]
    assert lost in final_status["excluded"]


@pytest.mark.timeout(240)
def test_killed_rank_restarts_in_place_bit_identical(job_factory, reference):
    job = job_factory()
    st = job.wait_for_step(INJECT_AFTER)
    victim = st["ranks"][2]
    os.kill(victim["pid"], signal.SIGKILL)  # a worker process this job started
    assert job.wait() == 0, job.diag()
    _assert_same_training(_final(job), reference)
    done = [e for e in job.events() if e["kind"] == "recovery_done"]
    assert done and done[0]["level"] == "process-restart", job.diag()
    final_status = job.status()
    assert final_status["ranks"][2]["node"] == victim["node"]
    assert final_status["ranks"][2]["worker_id"] != victim["worker_id"]


@pytest.mark.timeout(240)
def test_node_loss_without_spare_aborts_and_keeps_state(job_factory):
    job = job_factory(spares=0)
    st = job.wait_for_step(INJECT_AFTER)
    job.launcher.fail_node(st["ranks"][1]["node"])
    assert job.wait() == 3, job.diag()
    snaps = sorted((job.job_dir / "snapshots").glob("rank*-step*.pt"))
    assert snaps, job.diag()
    state = torch.load(snaps[0], weights_only=False)
    assert state["step"] >= INJECT_AFTER and "model" in state["objects"]
    assert any(e["kind"] == "job_failed" for e in job.events())
    assert not (job.job_dir / "final.pt").exists()
