"""NCCL: abort a communicator and build the next generation's (needs CUDA).

Skips cleanly without a GPU. With one GPU, a world of 1 exercises the same path
online recovery takes: collective, abort (``Generation.close``), new group on a
fresh store prefix, collective again.
"""

from datetime import timedelta

import pytest
import torch

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")]


def test_abort_and_rebuild_nccl_world_of_one():
    import torch.distributed as dist

    from slurm_resilience.model import RankSlot, RankTable
    from slurm_resilience.worker.reconnect import Generation

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    for g in (0, 1, 2):
        table = RankTable(generation=g, slots=(RankSlot(rank=0, node="gpu0", worker_id=f"w{g}", device="cuda:0"),))
        gen = Generation(store, table, 0, backend="nccl", timeout_s=20, poll_ms=20, interrupted=lambda: False)
        assert gen.backend == "nccl"
        t = torch.full((1024,), float(g + 1), device="cuda")
        gen.all_reduce_sum(t)
        assert torch.equal(t, torch.full_like(t, float(g + 1)))
        parked = gen.close()  # aborts the communicator: no 30-minute watchdog wait
        assert parked.pg is gen.pg
