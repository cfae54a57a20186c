"""End to end on the real local Slurm: losing the node that hosts rank 0.

Rank 0 is special in both modes: in a ``Session`` program it writes ``final.pt`` and is
the default source of a state broadcast; in ``run`` mode its node is ``MASTER_ADDR``,
the rendezvous every rank of the step connects to. Losing it must end like losing any
other node: the job finishes on the spare, bit-identical to a fault-free run, and no
later generation points at the lost node.
"""

import json

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

from . import test_restart_slurm as restart
from .conftest import STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

KILL_AT = 12


def _events(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


def test_online_rank0_node_loss_finishes_on_spare_bit_identical(cluster, jobs_root, reference):
    run = lab.submit(jobs_root / "rank0-node-loss", steps=STEPS)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][0]["node"]
    spare = status["spares"][0]["node"]
    lab.kill_node(victim)
    try:
        assert run.wait() == 0, run.output()
    finally:
        lab.cluster("revive-node", victim)
    # rank 0 of the new generation (on the spare) wrote final.pt; every rank's digest agrees
    assert lab.compare_states(reference, run.job_dir / "final.pt") == []
    ref_digests, got_digests = lab.rank_digests(reference.parent), lab.rank_digests(run.job_dir)
    assert len(got_digests) == 4 and got_digests == ref_digests
    assert [d["level"] for d in _events(run.job_dir, "recovery_done")] == ["node-replacement"]
    plans = _events(run.job_dir, "plan")
    assert plans[-1]["nodes"][0] == spare and all(victim not in p["nodes"] for p in plans[1:])


def test_relaunch_rank0_node_loss_moves_master_to_a_live_node_identical(cluster, jobs_root, torch_reference):
    """``run`` mode: the node of task 0 (MASTER_ADDR) is lost; the relaunched step's
    master is a node of the new step, never the lost one, and the result is identical."""
    import torch

    ref_out = torch_reference
    lab.cluster("reset")
    root = jobs_root / "torchrun-rank0-loss"
    proc, out = restart._run(root, restart.TORCH_EXAMPLE, 40, mpi=False)
    victim = restart._kill_after_first_snapshot(root, "snapshot.pt", index=0)
    try:
        assert restart._finish(proc, root) == 0, proc.output
        restart._check_recovered(root, victim)  # checks the node is DOWN: before the revive
    finally:
        lab.cluster("revive-node", victim)
    relaunch = _events(root / "job", "relaunch")[0]
    assert victim not in relaunch["nodes"]
    ref, got = torch.load(ref_out, weights_only=False), torch.load(out, weights_only=False)
    assert got["step"] == ref["step"] == 40
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, got["model"][name]), name
    for a, b in zip(ref["optimizer"]["state"].values(), got["optimizer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    # the relaunched step's first node (task 0, MASTER_ADDR) is a live node, not the lost one
    status = json.loads((root / "job" / "status.json").read_text())
    assert status["nodes"][0] != victim and victim not in status["nodes"]
