"""Lightning ``Resilience()`` on localhost: a lost "node" comes back bit-identical with
dropout, per-rank generators and gradient accumulation (tests/local/lightning_rng_job.py).

Two real ranks (gloo), each its own node (its own snapshot folder). Rank 1 SIGKILLs itself;
its node's snapshots are deleted (the node is gone), both ranks are started again: rank 1
gets the model, the loop position and its own generators (torch, Python, numpy) from
rank 0's snapshot. Compared with one fault-free run: weights (torch.equal), the next draw
of every generator on every rank, and the DataLoader workers' base seed of every batch
trained after the restore.

One job, ``accumulate_grad_batches=2``, killed twice: first after the first epoch's last
step (the restore starts the next epoch), then, restored, after the first micro-batch of a
window in the second epoch (the snapshot is the window's start, an optimizer step; the
window's batches are trained again, nothing accumulated is lost or counted twice).
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

JOB = Path(__file__).with_name("lightning_rng_job.py")
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root: Path, out: Path, accumulate: int, die_at: int = 0, tag: str = "0") -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SR_", "TORCHELASTIC"))}
    procs = []
    for rank in range(2):
        e = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": str(rank),
             "LOCAL_RANK": "0", "SLURMD_NODENAME": f"n{rank}", "SR_LIGHTNING_DIR": str(root / "snapshots"),
             "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        argv = [sys.executable, str(JOB), "--out", str(out), "--accumulate", str(accumulate), "--die-at", str(die_at)]
        procs.append(subprocess.Popen(argv, env=e, stdout=open(root / f"log-{rank}-{tag}.txt", "w"),
                                      stderr=subprocess.STDOUT))
    return procs


def _logs(root: Path) -> str:
    return "".join(f"--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(root.glob("log-*.txt")))


def _wait(procs: list[subprocess.Popen], which: list[int], root: Path) -> list[int]:
    """The exit codes of ``procs[i]`` for ``i`` in ``which``; a rank still running after
    180 s fails the test with every rank's Python stacks (the job dumps them on SIGUSR1)."""
    try:
        return [procs[i].wait(timeout=180) for i in which]
    except subprocess.TimeoutExpired:
        live = [p for p in procs if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGUSR1)
        time.sleep(2)  # let faulthandler write
        pytest.fail(f"a rank ran past 180 s; stacks and logs:\n{_logs(root)}")


def _finish(procs: list[subprocess.Popen], root: Path) -> None:
    try:
        codes = _wait(procs, [0, 1], root)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], _logs(root)


def _crash(root: Path, accumulate: int, die_at: int, tag: str) -> None:
    """Rank 1 kills itself after batch ``die_at``; rank 0 (stuck or failing on its dead peer)
    is then killed; the lost node's snapshots go with it."""
    procs = _launch(root, root / "crashed", accumulate, die_at, tag)
    try:
        assert _wait(procs, [1], root) == [-signal.SIGKILL], _logs(root)
        time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert (root / "snapshots" / "n0").is_dir()
    shutil.rmtree(root / "snapshots" / "n1", ignore_errors=True)


def _load(out: Path) -> list[dict]:
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """One fault-free run (accumulation 2), shared by both cases."""
    root = tmp_path_factory.mktemp("lightning-rng-ref")
    _finish(_launch(root, root / "out", 2), root)
    return _load(root / "out")


def test_a_lost_rank_resumes_with_its_own_generators_bit_identical(reference, tmp_path):
    _crash(tmp_path, 2, 8, "a")  # after the first epoch's last step (step 4)
    _crash(tmp_path, 2, 3, "b")  # restored at step 4, then 3 batches: step 5 and half of step 6's window
    _finish(_launch(tmp_path, tmp_path / "out", 2), tmp_path)
    got = _load(tmp_path / "out")
    logs = "".join((tmp_path / f"log-0-{tag}.txt").read_text() for tag in ("b", "0"))
    restored = [int(s.split()[0]) for s in logs.split("restored step ")[1:]]
    assert restored == [4, 5], logs[-3000:]  # each time the last optimizer step before the kill
    for rank in range(2):
        ref, run = reference[rank], got[rank]
        assert run["steps"] == ref["steps"] == 8
        assert all(torch.equal(ref["weights"][k], run["weights"][k]) for k in ref["weights"]), f"rank {rank} weights"
        assert run["draws"] == ref["draws"], f"rank {rank}: generators not where the fault-free run left them"
        # every batch the last run trained: (epoch, its loader iterator's base seed); not Lightning's
        # batch_idx, which after a restore from a run restored at an epoch's end counts from 0 (docs/lightning.md)
        replayed = [(e, seed) for e, _, seed in run["seeds"]]
        expected = [(e, seed) for e, _, seed in ref["seeds"]][-len(replayed):]
        assert replayed and replayed == expected, f"rank {rank}: DataLoader worker seeds"
    assert reference[0]["draws"] != reference[1]["draws"]  # the ranks' streams differ: a swap would show
