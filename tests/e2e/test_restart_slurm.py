"""End to end on the real local Slurm: unmodified programs, job-level recovery.

`slurm-resilience run` (3 nodes + 1 spare) with a node killed mid-run: the step
is relaunched with the spare in the lost node's slot, the program resumes from its
own snapshot, and its final weights equal those of a fault-free run of the same
program (torchrun-style on gloo: torch.equal; mpi4py: np.array_equal). With two
ranks per node (`--tasks-per-node 2`: 3 nodes x 2 ranks + a spare), the lost node's
two ranks come back on the spare and every rank's final state is compared.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.slurm import commands

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

TORCH_EXAMPLE = lab.REPO / "examples" / "train_torchrun.py"
MPI_EXAMPLE = lab.REPO / "examples" / "mpi_train.py"
# Loopback cluster: every node is 127.0.0.1 (gloo on lo; Open MPI over TCP, as root).
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMPI_MCA_btl": "self,tcp",
       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _run(root: Path, example: Path, steps: int, *, mpi: bool, spares: int = 1,
         tasks_per_node: int = 1) -> tuple[subprocess.Popen, Path]:
    """``tasks_per_node`` > 1: every rank writes its own final state (``final-{rank}.pt``)."""
    out = root / ("final.npy" if mpi else "final.pt" if tasks_per_node == 1 else "final-{rank}.pt")
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--nodes", "3",
            "--spares", str(spares), "--tasks-per-node", str(tasks_per_node),
            "--job-dir", str(root / "job"), *(["--mpi"] if mpi else []),
            "--", sys.executable, str(example), "--steps", str(steps), "--ckpt", str(root / "ckpt"),
            "--out", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV})
    return proc, out


def _finish(proc: subprocess.Popen, root: Path) -> int:
    code = proc.wait(timeout=240)
    log = root / "job" / "supervisor.log"
    proc.output = proc.stdout.read() + (log.read_text() if log.exists() else "")
    return code


def _kill_after_first_snapshot(root: Path, snapshot: str, index: int = 1) -> str:
    """Once the program's first snapshot exists, kill the node of worker ``index``."""
    deadline = time.time() + 120
    while not (root / "ckpt" / snapshot).exists():
        assert time.time() < deadline, "no snapshot within 120 s"
        time.sleep(0.05)
    import json

    victim = json.loads((root / "job" / "status.json").read_text())["nodes"][index]
    lab.kill_node(victim)
    return victim


def _kinds(root: Path) -> list[str]:
    return [e["kind"] for e in read_events(str(root / "job" / "events.jsonl"))]


def _check_recovered(root: Path, victim: str) -> None:
    events = read_events(str(root / "job" / "events.jsonl"))
    # mpi_path: `run --mpi` says first which path it took (test_mpi_program_... checks it)
    assert [e["kind"] for e in events if e["kind"] not in ("isolated", "mpi_path")] == [
        "job_start", "fault_detected", "ladder", "recovery_start", "relaunch", "phase", "phase", "phase", "phase",
        "recovery_done", "job_done"]
    _check_recovery_told(root, victim, events)
    assert [e["level"] for e in events if e["kind"] == "ladder"] == ["node-replacement"]
    fault = next(e for e in events if e["kind"] == "fault_detected")
    assert [f["node"] for f in fault["faults"]] == [victim] and fault["faults"][0]["kind"] == "node_lost"
    relaunch = next(e for e in events if e["kind"] == "relaunch")
    assert victim not in relaunch["nodes"] and "n5" in relaunch["nodes"]
    assert "from step 0" not in (root / "job" / "step-001.log").read_text()  # resumed from its snapshot
    node = commands.show_nodes([victim])[victim]
    assert "DOWN" in node["State"] and "slurm_resilience" in node.get("Reason", "")


def _check_recovery_told(root: Path, victim: str, events: list[dict]) -> None:
    """supervisor.log and ``timeline`` tell the recovery as for a Session job: the fault,
    the relaunch, its end at the relaunched program's first step (SR_PROGRESS_FILE)."""
    said = [ln.split("] ", 1)[-1] for ln in (root / "job" / "supervisor.log").read_text().splitlines()]
    want = (rf"fault: ranks? [\d,]+ on {victim}: NODE_LOST",
            r"recovery 1: node-replacement, relaunching the step \(relaunch 1\) on .*n5",
            r"recovery 1: relaunch 1 started on ", r"recovery 1 done: relaunch 1 trained a step")
    at = [next((i for i, ln in enumerate(said) if re.match(w, ln)), None) for w in want]
    assert None not in at and at == sorted(at), said
    done = next(e for e in events if e["kind"] == "recovery_done")
    assert done["step"] > 10 and done["detected"] < done["first_step"]  # resumed from a snapshot, then trained
    shown = subprocess.run([sys.executable, "-m", "slurm_resilience.cli", "timeline", str(root / "job")],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    summary = shown.split("\nrecovery 1: ", 1)[1].splitlines()
    assert summary[0] == f"{(done['t'] - done['detected']) * 1000:.1f} ms", shown
    assert [ln.split()[0] for ln in summary[2:6]] == ["classify", "replace", "ranktable", "first_step"], shown


@pytest.fixture(scope="module")
def mpi_reference(slurm_cluster, jobs_root) -> Path:
    lab.cluster("reset")
    proc, out = _run(jobs_root / "mpi-ref", MPI_EXAMPLE, 60, mpi=True)
    assert _finish(proc, jobs_root / "mpi-ref") == 0, proc.output
    return out


def test_torchrun_script_node_loss_relaunches_on_spare_identical(cluster, jobs_root, torch_reference):
    import torch

    root = jobs_root / "torchrun-node-loss"
    proc, out = _run(root, TORCH_EXAMPLE, 40, mpi=False)
    victim = _kill_after_first_snapshot(root, "snapshot.pt")
    assert _finish(proc, root) == 0, proc.output
    _check_recovered(root, victim)
    ref, got = torch.load(torch_reference, weights_only=False), torch.load(out, weights_only=False)
    assert got["step"] == ref["step"] == 40
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, got["model"][name]), name
    for a, b in zip(ref["optimizer"]["state"].values(), got["optimizer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


G2 = 2  # ranks per node: 3 worker nodes x 2 = 6 ranks; the spare n5 takes a lost node's 2


@pytest.fixture(scope="module")
def torch_reference_g2(slurm_cluster, jobs_root) -> Path:
    lab.cluster("reset")
    proc, out = _run(jobs_root / "torchrun-g2-ref", TORCH_EXAMPLE, 40, mpi=False, tasks_per_node=G2)
    assert _finish(proc, jobs_root / "torchrun-g2-ref") == 0, proc.output
    return out


def _rank_finals(pattern: Path, world: int) -> list[dict]:
    import torch

    return [torch.load(str(pattern).format(rank=r), weights_only=False) for r in range(world)]


@pytest.mark.timeout(480)  # two runs of 6 ranks (torch imports) on the 2-core box
def test_torchrun_two_ranks_per_node_node_loss_resumes_on_spare_identical(cluster, jobs_root, torch_reference_g2):
    import torch

    root = jobs_root / "torchrun-g2-node-loss"
    proc, out = _run(root, TORCH_EXAMPLE, 40, mpi=False, tasks_per_node=G2)
    victim = _kill_after_first_snapshot(root, "snapshot.pt")  # the 2nd worker node: ranks 2 and 3
    assert _finish(proc, root) == 0, proc.output
    _check_recovered(root, victim)
    # rank 0 of the relaunched step: all 6 ranks back, from a snapshot (10, 20 or 30)
    assert re.search(r"world 6, from step [1-3]0\b", (root / "job" / "step-001.log").read_text())
    world = 3 * G2
    placed = [r["node"] for r in json.loads((root / "job" / "status.json").read_text())["ranks"]]
    assert len(placed) == world and placed.count("n5") == G2 and victim not in placed
    refs, gots = _rank_finals(torch_reference_g2, world), _rank_finals(out, world)
    for rank, (ref, got) in enumerate(zip(refs, gots)):
        env = got["env"]  # the torchrun variables rank `rank` ran under, after the relaunch
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(world) and env["LOCAL_WORLD_SIZE"] == str(G2)
        assert (int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])) == divmod(rank, G2), env
        assert got["step"] == ref["step"] == 40
        for name, tensor in ref["model"].items():
            assert torch.equal(tensor, got["model"][name]), (rank, name)
        ref_opt, got_opt = ref["optimizer"]["state"], got["optimizer"]["state"]
        assert ref_opt.keys() == got_opt.keys()
        for key in ref_opt:
            assert torch.equal(ref_opt[key]["momentum_buffer"], got_opt[key]["momentum_buffer"]), (rank, key)
    # status.json's rank table says where each rank runs: it must be where Slurm put it
    # (block distribution over the step's nodes in allocation order, whatever -w says)
    assert [got["host"] for got in gots] == placed, "rank table vs. actual placement"


def test_mpi_program_node_loss_relaunches_on_spare_identical(cluster, jobs_root, mpi_reference):
    root = jobs_root / "mpi-node-loss"
    proc, out = _run(root, MPI_EXAMPLE, 60, mpi=True)
    victim = _kill_after_first_snapshot(root, "snapshot.npz", index=2)
    assert _finish(proc, root) == 0, proc.output
    _check_recovered(root, victim)
    first = read_events(str(root / "job" / "events.jsonl"))[0]
    assert first["kind"] == "mpi_path" and first["path"] == "relaunch" and "no ULFM" in first["reason"]
    assert np.array_equal(np.load(mpi_reference), np.load(out))


def test_no_spare_left_fails_with_one_line(cluster, jobs_root):
    root = jobs_root / "torchrun-no-spare"
    proc, _ = _run(root, TORCH_EXAMPLE, 40, mpi=False, spares=0)
    _kill_after_first_snapshot(root, "snapshot.pt")
    code = _finish(proc, root)
    assert code == 3, proc.output
    errors = [ln for ln in proc.output.splitlines() if ln.startswith("slurm-resilience: error:")]
    assert len(errors) == 1 and "no spare left" in errors[0], proc.output
    assert "Traceback" not in (root / "job" / "supervisor.log").read_text()
    # the isolation ends in the background: its event may come before or after the end
    assert [k for k in _kinds(root) if k != "isolated"][-2:] == ["ladder", "job_failed"]
    assert _kinds(root).count("isolated") == 1
    assert (root / "ckpt" / "snapshot.pt").exists()  # the program's own state is kept
