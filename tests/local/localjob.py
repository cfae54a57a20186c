"""A real Supervisor with LocalLauncher in a background thread, for tier-3 tests."""

import io
import json
import sys
import threading
import time
import shutil
from pathlib import Path

import torch

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.hdf5_format import shard_crc32
from slurm_resilience.config import load_config
from slurm_resilience.launch.localhost import LocalLauncher
from slurm_resilience.run_identity import establish
from slurm_resilience.supervisor.executors.online import Supervisor

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_mlp.py"
ZERO = TRAIN.with_name("train_zero.py")  # sharded (ZeRO-1-style) optimizer state
STEPS = 40
STEP_TIME = 0.1
INJECT_AFTER = 5  # fault once every rank has reported this step


class LocalJob:
    """A Supervisor in a background thread; the test is the fault injector."""

    def __init__(self, root: Path, *, nodes: int = 3, spares: int = 1, steps: int = STEPS,
                 step_time: float = STEP_TIME, checkpoint: dict | None = None,
                 job_name: str = "job", local_dir: Path | None = None,
                 recovery: dict | None = None, detect: dict | None = None, reconnect: dict | None = None,
                 extra_args: tuple[str, ...] = (), script: Path = TRAIN, tasks_per_node: int = 1,
                 run_id: str | None = None) -> None:
        """``run_id``: the run this job continues (its checkpoints are restored); None: the
        job directory's recorded one if it ran before, else a new run (``run_identity``)."""
        cfg = load_config({
            "reconnect": {"gloo_ifname": "lo", **(reconnect or {})},
            "job": {"nodes": nodes, "spares": spares, "tasks_per_node": tasks_per_node},
            "checkpoint": {"local_dir": str((local_dir or root / "local") / "{node}/ckpt"),
                           **(checkpoint or {})},
            # a warm standby per worker node is 3 more torch imports per job on the 2-core CI box:
            # off unless a test asks for it (test_local_recovery.py's restart in place does)
            "recovery": {"local_standbys": False, **(recovery or {})},
            "detect": detect or {},
        })
        self.job_dir = root / job_name
        self.launcher = LocalLauncher()
        self.out = io.StringIO()
        self.sup = Supervisor(
            config=cfg,
            command=[sys.executable, str(script), "--steps", str(steps), "--step-time", str(step_time), *extra_args],
            job_dir=str(self.job_dir),
            nodes=[f"local{i}" for i in range(1, nodes + spares + 1)],
            launcher=self.launcher, store_host="127.0.0.1", job_id="test", out=self.out,
            # a job directory run again is the same run (as `slurm-resilience local` on it)
            run_id=establish(str(self.job_dir), run_id, resumed=True))
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

    def local_standby(self, node: str, timeout_s: float = 60.0) -> dict:
        """``node``'s warm standby (recovery.local_standbys) once it is connected (status.json)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = [s for s in (self.status() or {}).get("local_standbys", []) if s["node"] == node and s["connected"]]
            if got and got[0]["pid"]:
                return got[0]
            time.sleep(0.05)
        raise AssertionError(f"no connected standby on {node}: {self.status()}\n{self.diag()}")

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


def rank_digests(job: LocalJob) -> dict[int, str]:
    """Each rank's final-state digest (from its ``done`` event), by rank."""
    return {e["rank"]: e["digest"] for e in job.events() if e["kind"] == "rank_done"}


def final_state(job: LocalJob) -> dict:
    """Rank 0's ``final.pt``, with every rank's final-state digest under ``"digests"``."""
    state = torch.load(job.job_dir / "final.pt", weights_only=False)
    state["digests"] = rank_digests(job)
    return state


def assert_bit_identical(a, b, where="state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bit_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_training(got: dict, ref: dict) -> None:
    assert got["step"] == ref["step"] == STEPS
    assert_bit_identical(got["objects"]["model"], ref["objects"]["model"], "model")
    assert_bit_identical(got["objects"]["optimizer"], ref["objects"]["optimizer"], "optimizer")
    assert ref["objects"]["optimizer"]["state"], "the optimizer has momentum buffers to compare"
    assert got["objects"]["scheduler"] == ref["objects"]["scheduler"], "LR scheduler"
    assert got["extras"] == ref["extras"] and ref["extras"]["lr_sum"] > 0, "user extras"
    assert got["position"] == ref["position"]
    assert torch.equal(got["rng"]["torch"], ref["rng"]["torch"]), "torch RNG state"
    # every rank's final state, not only rank 0's: one digest per rank of the same world
    assert sorted(ref["digests"]) == list(range(len(ref["digests"]))) and ref["digests"], ref["digests"]
    assert got["digests"] == ref["digests"], "a rank's final state differs from the reference"


GATHERED_RUN = "d" * 32  # the run a gathered checkpoint is stamped with: a job started from it passes it


def gather_l1(local: Path, step: int, dst: Path, world: int = 3) -> None:
    """A shared-tier root at ``dst`` holding ``step``'s L1 shards as a ``world``-rank
    job's nodes held them (rank r ran on local{r+1}, tier directory ``ckpt``): how a test
    starts a fresh job from another job's checkpoint of that step (``run_id=GATHERED_RUN``:
    a checkpoint is restored by its own run only)."""
    shards = {}
    for r in range(world):
        src = mf.shard_path(str(local / f"local{r + 1}" / "ckpt"), step, r)
        to = mf.shard_path(str(dst), step, r)
        Path(to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, to)
        shards[r] = mf.ShardRecord(mf.shard_name(r), Path(to).stat().st_size, shard_crc32(to))
    mf.write_manifest(str(dst), mf.Manifest(step=step, world_size=world, tier="L2", shards=shards, created=0.0,
                                            extra={}, run_id=GATHERED_RUN))
    mf.set_latest(str(dst), step)
