"""`slurm-resilience run --mpi` on the real local Slurm: the path it chooses, G = 2.

* in place, 2 ranks per node (2 worker nodes x 2 active ranks + 1 spare node x 2
  spare ranks): a rank SIGKILLed -> a spare rank takes its number, no process started,
  final state bit-identical to a fault-free 4-rank run;
* in place, a whole worker node killed (its ranks and its PRRTE daemon): PRRTE 3.0.11
  ends the job, the supervisor relaunches mpirun with a spare node in the lost
  node's place, the program resumes from its own snapshot; then the other worker
  node frozen: the supervisor finds it (quiet beat files, silent slurmd), ends
  mpirun and relaunches on the second spare node; bit-identical;
* relaunch: an mpi4py program on Debian's Open MPI (no ULFM) takes the relaunch path
  and says why; a rank SIGKILLed on a healthy node ends the step (``srun
  --kill-on-bad-exit=1``), a rank SIGSTOPped is found by its step's silent progress
  file; each time the step is relaunched in place and resumes from the program's
  snapshot, bit-identical to a fault-free run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.mpi.launch import DEFAULT_VENV

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]
VENV = os.environ.get("SR_ULFM_VENV", DEFAULT_VENV)
PYTHON = os.path.join(VENV, "bin", "python")
EXAMPLE = lab.REPO / "examples" / "mpi_ulfm_train.py"
STEPS = 40
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(lab.REPO)}

if not os.access(os.path.join(VENV, "bin", "mpirun"), os.X_OK):
    pytest.fail(f"no ULFM Open MPI in {VENV}: run scripts/install-deps.sh", pytrace=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Fault-free, 4 active ranks on this host (the same sums in rank order)."""
    out = tmp_path_factory.mktemp("ulfm-g2-ref") / "final.npz"
    argv = [os.path.join(VENV, "bin", "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", "4",
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
            PYTHON, str(EXAMPLE), "--spares", "0", "--steps", str(STEPS), "--out", str(out)]
    proc = subprocess.run(argv, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _run(root: Path, *program: str, nodes: int = 2, g: int = 2, spares: int = 1,
         config: Path | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--mpi", "--nodes", str(nodes),
            "--spares", str(spares), "--tasks-per-node", str(g), "--job-dir", str(root / "job"),
            *(["--config", str(config)] if config else []), "--", *program]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV})


def _ulfm(root: Path, root_dir: Path, steps_before: int = 10, spares: int = 1) -> tuple[subprocess.Popen, Path]:
    out = root / "final.npz"
    proc = _run(root, PYTHON, str(EXAMPLE), "--steps", str(STEPS), "--step-time", "0.15", "--out", str(out),
                "--snapshot", str(root / "snap"), "--snapshot-every", "5", spares=spares)
    return proc, out


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"run ended ({proc.returncode}) before {what}: {proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _last_step(progress: Path) -> int:
    try:
        lines = progress.read_text().splitlines()
    except FileNotFoundError:
        return -1
    return int(lines[-1].split()[0]) if lines else -1


def _rank_events(ev_dir: Path) -> list[dict]:
    recs = []
    for f in sorted(ev_dir.glob("events-w*.jsonl")):
        recs += [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
    return recs


def _finish(proc: subprocess.Popen, job: Path) -> str:
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # the `run --wait` client this test started
            out = proc.stdout.read()
            ids = re.findall(r"submitted job (\d+)", out)
            if ids:  # and the job it submitted
                subprocess.run(["scancel", ids[0]], capture_output=True, timeout=30)
            raise AssertionError(f"run --wait did not end within 120 s: {out}")
    log = job / "supervisor.log"
    return proc.stdout.read() + (log.read_text() if log.exists() else "")


def _same(a: Path, b: Path) -> None:
    x, y = np.load(a), np.load(b)
    assert sorted(x.files) == sorted(y.files)
    for k in x.files:
        assert x[k].tobytes() == y[k].tobytes(), f"{k} differs from the fault-free run"


def test_g2_rank_killed_is_repaired_in_place(cluster, tmp_path, reference):
    proc, out = _ulfm(tmp_path, tmp_path)
    job = tmp_path / "job"
    _wait(lambda: _last_step(job / "progress-000.log") >= 10, 90, "step 10", proc)
    starts = {r["wid"]: r for r in _rank_events(job / "ulfm-000") if r["kind"] == "start"}
    assert len(starts) == 6 and [starts[w]["rank"] for w in range(6)] == [0, 1, 2, 3, -1, -1]
    assert starts[0]["node"] == starts[1]["node"] != starts[2]["node"] == starts[3]["node"]
    os.kill(starts[1]["pid"], signal.SIGKILL)  # a rank of the job this test started
    output = _finish(proc, job)
    assert proc.returncode == 0, output
    assert "MPI recovery path: in-place repair (ULFM): mpi4py loads Open MPI 5.0.11" in output
    events = read_events(str(job / "events.jsonl"))
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "mpi_path" and events[0]["path"] == "in-place"
    assert "relaunch" not in kinds and kinds.count("ulfm_launch") == 1
    repaired = [e for e in events if e["kind"] == "ulfm_repaired"]
    assert len(repaired) == 1 and repaired[0]["lost"] == [1] and repaired[0]["promoted"] == {"4": 1}
    recs = _rank_events(job / "ulfm-000")
    assert len([r for r in recs if r["kind"] == "start"]) == 6  # no process started
    exits = {r["wid"]: r for r in recs if r["kind"] == "exit"}
    assert sorted(exits) == [0, 2, 3, 4, 5] and exits[4]["rank"] == 1 and exits[5]["rank"] == -1
    _same(reference, out)


def test_g2_node_killed_then_another_frozen_each_relaunches_on_a_spare_node(cluster, tmp_path, reference):
    """Two spare nodes. A worker node killed: PRRTE ends the job, the first spare takes its
    place. Then the other worker node frozen (nothing closed; PRRTE would wait on it for
    good): its processes' beat files go quiet, its slurmd does not answer, the supervisor
    ends mpirun and the second spare takes its place. Bit-identical to a fault-free run."""
    proc, out = _ulfm(tmp_path, tmp_path, spares=2)
    job = tmp_path / "job"
    _wait(lambda: (tmp_path / "snap" / "snapshot.npz").exists() and _last_step(job / "progress-000.log") >= 12,
          90, "a snapshot and step 12", proc)
    starts = {r["wid"]: r for r in _rank_events(job / "ulfm-000") if r["kind"] == "start"}
    killed, frozen = starts[2]["node"], starts[0]["node"]  # the second worker node, then the first
    lab.kill_node(killed)
    try:
        _wait(lambda: _last_step(job / "progress-001.log") >= 20, 90, "step 20 after the relaunch", proc)
        frozen_at = lab.freeze_node(frozen)
        try:
            output = _finish(proc, job)
        finally:
            lab.thaw_and_revive(frozen)
    finally:
        lab.cluster("revive-node", killed)
    assert proc.returncode == 0, output
    events = read_events(str(job / "events.jsonl"))
    relaunch = [e for e in events if e["kind"] == "relaunch"]
    assert len(relaunch) == 2, output
    assert relaunch[0]["lost"] == [killed] and "PRRTE ends a job that loses a daemon" in relaunch[0]["reason"]
    assert killed not in relaunch[0]["workers"] and len(relaunch[0]["workers"]) == 2
    assert len(relaunch[0]["spares"]) == 1
    silent = [e for e in events if e["kind"] == "ulfm_node_silent"]
    assert [e["node"] for e in silent] == [frozen] and silent[0]["t"] > frozen_at, output
    assert relaunch[1]["lost"] == [frozen] and relaunch[1]["spares"] == []
    assert frozen not in relaunch[1]["workers"] and killed not in relaunch[1]["workers"]
    for attempt, r in ((1, relaunch[0]), (2, relaunch[1])):
        restarted = _rank_events(job / f"ulfm-{attempt:03d}")
        assert {r2["node"] for r2 in restarted if r2["kind"] == "start"} == {*r["workers"], *r["spares"]}
    _same(reference, out)


def _plain_rank_pid(marker: str, rank: int) -> int | None:
    """The process of MPI rank ``rank`` of examples/mpi_train.py whose argv holds ``marker``."""
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if not d.name.isdigit() or marker.encode() not in argv:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PMIX_RANK={rank}".encode() in env:
            return int(d.name)
    return None


def test_debian_open_mpi_relaunch_path_survives_a_killed_then_a_stopped_rank(cluster, tmp_path):
    """The relaunch path, and two faults on healthy nodes. Rank 1 SIGKILLed: the step is
    launched with ``--kill-on-bad-exit=1``, so Slurm ends it (the survivors would block
    in their Allreduce for ever) and the supervisor relaunches it in place. Then rank 1
    of that relaunch SIGSTOPped: nothing exits, the progress lines stop, and past the hard
    step timeout (``detect.progress_hard_s``, 3 s here) the step is hung, ended and
    relaunched again. Each relaunch resumes from the program's snapshot; the end is
    bit-identical to a fault-free run of the same 2 ranks."""
    program = [sys.executable, str(lab.REPO / "examples" / "mpi_train.py"), "--steps", "40"]
    ref = tmp_path / "ref.npy"
    subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", *program, "--step-time", "0",
                    "--ckpt", str(tmp_path / "ref-ckpt"), "--out", str(ref)],
                   check=True, capture_output=True, timeout=60)
    config = tmp_path / "config.yaml"
    config.write_text("detect:\n  progress_soft_s: 2.5\n  progress_hard_s: 3.0\n")
    ckpt = str(tmp_path / "ckpt")
    proc = _run(tmp_path, *program, "--step-time", "0.1", "--ckpt", ckpt, "--out", str(tmp_path / "final.npy"),
                nodes=2, g=1, config=config)
    job = tmp_path / "job"
    _wait(lambda: _last_step(job / "progress-000.log") >= 12, 60, "step 12 (after the snapshot of step 10)", proc)
    os.kill(_wait(lambda: _plain_rank_pid(ckpt, 1), 10, "rank 1's process", proc), signal.SIGKILL)
    _wait(lambda: _last_step(job / "progress-001.log") >= 22, 60, "relaunch 1's step 22", proc)
    os.kill(_wait(lambda: _plain_rank_pid(ckpt, 1), 10, "rank 1's process", proc), signal.SIGSTOP)
    output = _finish(proc, job)  # the processes of the job this test started, ended by its own steps
    assert proc.returncode == 0, output
    line = "MPI recovery path: relaunch of the whole step: "
    assert f"{line}{sys.executable}'s mpi4py loads Open MPI v4.1" in output, output
    events = read_events(str(job / "events.jsonl"))
    assert events[0]["kind"] == "mpi_path" and events[0]["path"] == "relaunch" and "no ULFM" in events[0]["reason"]
    faults = [e["fault"] for e in events if e["kind"] == "fault_detected"]
    assert [f["kind"] for f in faults] == ["process_died", "process_hung"], output
    assert re.search(r"first bad exit: n\d+ task 1: Killed", faults[0]["detail"]), faults[0]
    assert "past the hard step timeout 3.0 s" in faults[1]["detail"], faults[1]
    assert [e["level"] for e in events if e["kind"] == "recovery_done"] == ["process-restart"] * 2, output
    workers = next(e["nodes"] for e in events if e["kind"] == "job_start")  # in place: the spare stays free
    assert [e["nodes"] for e in events if e["kind"] == "relaunch"] == [workers, workers]
    for attempt in (1, 2):  # resumed from a snapshot, not from step 0
        first = int((job / f"progress-{attempt:03d}.log").read_text().split()[0])
        assert first in (11, 21, 31), (attempt, first)
    assert (tmp_path / "final.npy").read_bytes() == ref.read_bytes()
