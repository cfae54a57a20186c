"""Driving jobs on the local cluster: submit, wait, inject a fault, verify, summarize.

Shared by ``scripts/demo.py``, the end-to-end tests and the benchmarks, so each of
them proves the same path. Faults are injected only into processes this job
started (by PID) or through ``scripts/local-cluster kill-node`` / ``freeze-node``.

Which ``local-cluster`` script runs (:func:`local_cluster_script`), first found:
``$SR_LOCAL_CLUSTER``; the checkout's ``scripts/local-cluster`` (an editable install);
the script recorded in the lab directory by ``local-cluster start``
(``LAB/local-cluster.path``; the lab from ``$SR_LAB``, from ``$SLURM_CONF`` =
``LAB/etc/slurm.conf``, or ``/tmp/sr-cluster``); ``local-cluster`` on ``PATH``. An
installed wheel has no checkout: it finds the lab's record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import ResilienceError
from .events import read_events
from .protocol import EventKind, RecoveryPhase, WorkerEvent


__all__ = [
    "REPO", "LOCAL_CLUSTER", "EXAMPLE", "ZERO_EXAMPLE", "LOCAL_CONFIG", "LAB_RECORD", "DEFAULT_LAB", "LabError",
    "local_cluster_script", "cluster", "net_fault", "podman_test_image", "podman_section", "kill_node", "freeze_node",
    "thaw_and_revive", "JobRun", "submit", "compare_states", "compare_runs", "rank_digests", "PHASES", "summarize",
    "checkpoint_overhead", "format_summary"
]


REPO = Path(__file__).resolve().parents[1]
LOCAL_CLUSTER = REPO / "scripts" / "local-cluster"
EXAMPLE = REPO / "examples" / "train_mlp.py"
ZERO_EXAMPLE = REPO / "examples" / "train_zero.py"  # ZeRO-style sharded optimizer state
LOCAL_CONFIG = REPO / "examples" / "local-cluster.yaml"
LAB_RECORD = "local-cluster.path"  # in the lab directory: the script that started it
DEFAULT_LAB = "/tmp/sr-cluster"


class LabError(ResilienceError, RuntimeError):
    """The local cluster's script is missing or failed (one line, no traceback)."""


def _lab_dirs(env: Mapping[str, str]) -> list[str]:
    """Where a lab may be: ``$SR_LAB``, the lab of ``$SLURM_CONF``, the default."""
    dirs = [env["SR_LAB"]] if env.get("SR_LAB") else []
    conf = Path(env.get("SLURM_CONF", ""))
    if conf.name == "slurm.conf" and conf.parent.name == "etc":
        dirs.append(str(conf.parent.parent))
    return [*dirs, DEFAULT_LAB]


def _recorded_script(lab_dir: str) -> Path | None:
    """The script named by ``LAB/local-cluster.path``; None when there is no record this
    user may trust (it must belong to root or to us and be writable by no one else:
    /tmp is everyone's, and the script it names is run)."""
    record = os.path.join(lab_dir, LAB_RECORD)
    try:
        st = os.stat(record)
        with open(record) as f:
            script = Path(f.read().strip())
    except OSError:
        return None
    if st.st_uid not in (0, os.getuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    return script if script.is_absolute() and script.is_file() else None


def local_cluster_script(env: Mapping[str, str] | None = None) -> tuple[Path, str | None]:
    """``(script, lab directory to pass with --lab, or None for the script's default)``;
    the order is in the module docstring. Raises :class:`LabError` when none is found."""
    env = os.environ if env is None else env
    given = env.get("SR_LOCAL_CLUSTER")
    if given:
        if not Path(given).is_file():
            raise LabError(f"SR_LOCAL_CLUSTER={given} is not a file: name the lab's scripts/local-cluster")
        return Path(given), None
    if LOCAL_CLUSTER.is_file():
        return LOCAL_CLUSTER, None
    dirs = _lab_dirs(env)
    for lab_dir in dirs:
        script = _recorded_script(lab_dir)
        if script is not None:
            return script, lab_dir
    on_path = shutil.which("local-cluster", path=env.get("PATH", os.defpath))
    if on_path:
        return Path(on_path), None
    raise LabError(f"node faults need the local cluster's scripts/local-cluster: none in an installed package, "
                   f"no {LAB_RECORD} in {' or '.join(dict.fromkeys(dirs))} (written by `local-cluster start`), "
                   f"none on PATH; set SR_LOCAL_CLUSTER=/path/to/scripts/local-cluster")


def cluster(*args: str, timeout: float = 120) -> str:
    """Run ``scripts/local-cluster ARGS``; returns stdout, raises :class:`LabError` on failure."""
    script, lab_dir = local_cluster_script()
    lab_args = ["--lab", lab_dir] if lab_dir else []
    proc = subprocess.run([sys.executable, str(script), *lab_args, *args], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise LabError(f"{script} {' '.join(args)} failed: {last[0]}")
    return proc.stdout


def net_fault(*args: str, timeout: float = 60) -> float:
    """A network fault (``local-cluster partition-node NODE``, ``partition-peers``,
    ``partition-supervisor``, ``lossy-node``, ``slow-node``, ``flap-node``, ``heal``); returns its wall
    time (a flap returns once healed: the time it began)."""
    out = cluster(*args, timeout=timeout)
    m = re.search(r"\bat=([0-9.]+)", out) or re.search(r"healed_at=([0-9.]+)", out)
    return float(m.group(1)) if m else time.time()


def podman_test_image() -> str:
    """Build (once per machine) the podman image of the container tests and benchmark
    (``containers/test-image.sh``); returns its name."""
    out = subprocess.run([str(REPO / "containers" / "test-image.sh")], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"containers/test-image.sh failed: {out.stderr.strip()}")
    return out.stdout.strip().splitlines()[-1]


def podman_section(image: str) -> dict[str, Any]:
    """A ``container:`` section that runs the steps in ``image`` with the host's /usr,
    this interpreter and the repository bind-mounted (the lab's nodes share them)."""
    prefix = Path(sys.prefix).resolve()
    mounts = ["/usr:/usr:ro", "/etc/passwd:/etc/passwd:ro", "/etc/group:/etc/group:ro", "/tmp:/tmp",
              f"{REPO}:{REPO}:ro"]
    if not str(prefix).startswith("/usr/"):
        mounts.append(f"{prefix}:{prefix}:ro")
    return {"runtime": "podman", "image": image, "mounts": mounts, "env": ["PYTHONPATH", "USER"]}


def kill_node(node: str) -> float:
    """Hard node loss; returns the wall time of the kill."""
    out = cluster("kill-node", node, timeout=30)
    m = re.search(r"killed_at=([0-9.]+)", out)
    return float(m.group(1)) if m else time.time()


def freeze_node(node: str) -> float:
    """Silent node loss (``local-cluster freeze-node``: slurmd stopped, job cgroups
    frozen, nothing closed); returns the wall time of the freeze."""
    out = cluster("freeze-node", node, timeout=30)
    m = re.search(r"frozen_at=([0-9.]+)", out)
    return float(m.group(1)) if m else time.time()


def thaw_and_revive(node: str) -> None:
    """Undo ``freeze_node``: thaw the node and make it usable again (revive-node)."""
    cluster("thaw-node", node, timeout=30)
    cluster("revive-node", node, timeout=60)


@dataclasses.dataclass
class JobRun:
    """A job submitted with ``slurm-resilience submit --wait`` in the background
    (``process`` None: submitted otherwise, e.g. by an executor; only watched here)."""

    job_dir: Path
    process: subprocess.Popen | None

    @property
    def status(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.job_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def wait_for_step(self, step: int, timeout: float = 120) -> dict[str, Any]:
        """Block until every rank has completed ``step`` steps; returns the status."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            st = self.status
            if st and st["ranks"] and min(r["step"] for r in st["ranks"]) >= step:
                return st
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"job ended before step {step}: {self.output()}")
            time.sleep(0.1)
        raise TimeoutError(f"no step {step} within {timeout}s; status {self.status}")

    def wait(self, timeout: float = 300) -> int:
        return self.process.wait(timeout=timeout)

    def output(self) -> str:
        proc = self.process
        out = proc.stdout.read() if proc is not None and proc.stdout and proc.poll() is not None else ""
        log = self.job_dir / "supervisor.log"
        return out + (log.read_text() if log.exists() else "")


def submit(job_dir: Path, *, nodes: int = 4, spares: int = 1, tasks_per_node: int = 1, steps: int = 40,
           step_time: float = 0.05, config: Path | None = LOCAL_CONFIG,
           extra_args: Sequence[str] = (), hetjob: bool = False, script: Path = EXAMPLE,
           cli_args: Sequence[str] = (), as_user: Sequence[str] = ()) -> JobRun:
    """``hetjob``: submit as a heterogeneous job (supervisor component + worker component).
    ``cli_args``: more ``submit`` flags (``--sbatch-option``, ``--setup`` ...).
    ``tasks_per_node``: G ranks on each of the ``nodes`` worker nodes, G standbys per spare.
    ``as_user``: an argv prefix that runs ``submit`` with another user's credentials
    (e.g. ``runuser -u USER -- env SLURM_CONF=… PYTHONPATH=…``); it runs in the job
    directory's parent, which that user must own."""
    argv = [*as_user, sys.executable, "-m", "slurm_resilience.cli", "submit", "--wait",
            "--nodes", str(nodes), "--spares", str(spares), "--tasks-per-node", str(tasks_per_node),
            "--job-dir", str(job_dir)]
    if hetjob:
        argv.append("--hetjob")
    if config is not None:
        argv += ["--config", str(config)]
    argv += [*cli_args, "--", sys.executable, str(script), "--steps", str(steps),
             "--step-time", str(step_time), *extra_args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(job_dir).parent) if as_user else None)
    return JobRun(job_dir=Path(job_dir), process=proc)


def compare_states(a: Path, b: Path) -> list[str]:
    """Names of the tensors/values that differ between two final states (empty: bit-identical).

    A state with no tensors at all is a difference (two empty states are not a proof of
    anything); the torch (and CUDA) RNG state is compared with the weights: a recovery
    that restored the weights but not the generator would diverge at the next dropout."""
    import torch

    sa = torch.load(a, weights_only=False)
    sb = torch.load(b, weights_only=False)
    diffs: list[str] = []
    if not _has_tensor(sa.get("objects")) or not _has_tensor(sb.get("objects")):
        diffs.append("objects: a state holds no tensor to compare")
    _compare(sa["objects"], sb["objects"], "state", diffs)
    _compare(sa.get("extras", {}), sb.get("extras", {}), "extras", diffs)
    rng_a, rng_b = sa.get("rng", {}), sb.get("rng", {})
    if "torch" not in rng_a or "torch" not in rng_b:
        diffs.append("rng: a state has no torch RNG state")
    for key in ("torch", "cuda"):
        _compare(rng_a.get(key), rng_b.get(key), f"rng.{key}", diffs)
    if sa.get("position") != sb.get("position"):
        diffs.append(f"position {sa.get('position')} != {sb.get('position')}")
    if sa["step"] != sb["step"]:
        diffs.append(f"step {sa['step']} != {sb['step']}")
    return diffs


def compare_runs(a: Path, b: Path) -> list[str]:
    """Two runs' final states, every rank's: rank 0's ``final.pt`` tensor by tensor
    (:func:`compare_states`) and each rank's final-state digest (its ``done`` event).

    ``a``, ``b``: job directories, or their ``final.pt``. Both runs must report a digest
    for every rank 0..N-1 of the same world."""
    dir_a, dir_b = (Path(p).parent if Path(p).suffix == ".pt" else Path(p) for p in (a, b))
    diffs = compare_states(dir_a / "final.pt", dir_b / "final.pt")
    da, db = rank_digests(dir_a), rank_digests(dir_b)
    for where, d in (("first", da), ("second", db)):
        if not d or sorted(d) != list(range(len(d))):
            diffs.append(f"digests: the {where} run has digests of ranks {sorted(d)}, not of every rank")
    diffs += [f"rank {r}: final state differs" for r in sorted(set(da) | set(db)) if da.get(r) != db.get(r)]
    return diffs


def _has_tensor(x: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() > 0
    if isinstance(x, dict):
        return any(_has_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_tensor(v) for v in x)
    return False


def rank_digests(job_dir: Path) -> dict[int, str]:
    """Each rank's final-state digest (its ``done`` event), by rank: comparing two runs'
    digests compares every rank's final state, not only rank 0's ``final.pt``."""
    events = read_events(str(Path(job_dir) / "events.jsonl"))
    return {e["rank"]: e["digest"] for e in events
            if e["kind"] == WorkerEvent.DONE.logged and "digest" in e}


def _compare(x: Any, y: Any, path: str, diffs: list[str]) -> None:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        same = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(x, y))
        if not same:
            diffs.append(path)
    elif isinstance(x, dict) and isinstance(y, dict):
        if set(x) != set(y):
            diffs.append(f"{path}: keys differ")
        for k in set(x) & set(y):
            _compare(x[k], y[k], f"{path}.{k}", diffs)
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            _compare(u, v, f"{path}[{i}]", diffs)
    elif x != y:
        diffs.append(path)


# The demo summary's rows: the recovery's own phases (``phase`` events) framed by two
# that no ``phase`` event carries: "detect" (injected fault → detection, known only
# to whoever injected it) and "isolate" (draining the bad node, off the critical path).
DETECT, ISOLATE = "detect", "isolate"
PHASES = (DETECT, ISOLATE, *(p.value for p in RecoveryPhase))


def summarize(job_dir: Path, fault_at: float | None) -> dict[str, Any]:
    """Recovery timeline from the job's event log; MTTR is fault → first completed step."""
    events = read_events(str(job_dir / "events.jsonl"))
    recoveries = [e for e in events if e["kind"] == EventKind.RECOVERY_DONE]
    summary: dict[str, Any] = {"recoveries": len(recoveries), "phases": {}, "mttr_s": None}
    if not recoveries:
        return summary
    first = recoveries[0]
    n = first["recovery"]
    phases = {e["phase"]: e for e in events if e["kind"] == EventKind.PHASE and e["recovery"] == n}
    detected = first["detected"]
    out: dict[str, dict[str, float]] = {}
    if fault_at is not None:
        out[DETECT] = _span(fault_at, detected)
    iso = next((e for e in events if e["kind"] == EventKind.ISOLATED), None)
    if iso:
        out[f"{ISOLATE} (off the critical path)"] = _span(iso["start"], iso["end"])
    for name in RecoveryPhase:
        out[name.value] = _span(phases[name]["start"], phases[name]["end"])
    summary["phases"] = out
    start = fault_at if fault_at is not None else detected
    summary["mttr_s"] = round(first["first_step"] - start, 4)
    summary["level"] = first["level"]
    summary["checkpoint"] = checkpoint_overhead(events)
    return summary


def checkpoint_overhead(events: list[dict[str, Any]], rank: int = 0) -> dict[str, Any]:
    """Training time lost to checkpoint stalls on one rank, as a share of its training time."""
    mine = [e for e in events if e.get("rank") == rank]
    stalls = [e["stall_ms"] for e in mine if e["kind"] == WorkerEvent.CHECKPOINT_SAVED.logged]
    start = next((e["t"] for e in mine if e["kind"] == WorkerEvent.RESTORED.logged), None)
    end = next((e["t"] for e in reversed(mine) if e["kind"] == WorkerEvent.DONE.logged), None)
    if not stalls or start is None or end is None:
        return {"checkpoints": len(stalls)}
    train_ms = (end - start) * 1000
    durable = [e for e in events if e["kind"] == WorkerEvent.CHECKPOINT_DURABLE.logged]
    return {"checkpoints": len(stalls), "mean_stall_ms": round(sum(stalls) / len(stalls), 3),
            "overhead_pct": round(100 * sum(stalls) / train_ms, 4),
            "durable_writes": len(durable),
            "failed": sum(1 for e in events if e["kind"] == WorkerEvent.CHECKPOINT_FAILED.logged)}


def _span(start: float, end: float) -> dict[str, float]:
    return {"start": start, "end": end, "duration_ms": round((end - start) * 1000, 2)}


def format_summary(summary: dict[str, Any], fault_at: float | None) -> str:
    """The phases of one recovery as a table, in ms from the fault (or from the first phase)."""
    lines = []
    t0 = fault_at if fault_at is not None else min(p["start"] for p in summary["phases"].values())
    lines.append(f"{'phase':<32}{'at (ms)':>10}{'duration (ms)':>16}")
    if fault_at is not None:
        lines.append(f"{'fault injected':<32}{0.0:>10.1f}{'':>16}")
    for name, p in summary["phases"].items():
        lines.append(f"{name:<32}{(p['start'] - t0) * 1000:>10.1f}{p['duration_ms']:>16.1f}")
    if summary["mttr_s"] is not None:
        lines.append(f"MTTR (fault -> first completed step after recovery): {summary['mttr_s'] * 1000:.0f} ms")
    return "\n".join(lines)
