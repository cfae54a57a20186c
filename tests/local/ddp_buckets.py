"""One rank of the DDP bucket-layout experiment (run by test_ddp.py, 3 processes).

Trains 8 steps twice: once with one DDP throughout, once with the DDP rebuilt at step 4
(as after a recovery). Prints whether the final weights are bit-identical.
Usage: ddp_buckets.py RANK WORLD FILESTORE default|static
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from slurm_resilience.worker.rebind import static_buckets


def main() -> None:
    rank, world, path, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)

    def wrap(m):
        ddp = DistributedDataParallel(m)
        if mode == "static":
            static_buckets(ddp)
        return ddp

    def train(rebuild_at: int):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        ddp = wrap(m)
        g = torch.Generator().manual_seed(rank)
        for s in range(8):
            if s == rebuild_at:
                ddp.reducer._remove_autograd_hooks()
                ddp = wrap(m)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    same = all(torch.equal(a, b) for a, b in zip(train(-1), train(4)))
    print("identical" if same else "different", flush=True)
    dist.barrier()  # every rank done with its DDPs before any tears the group (and its store) down
    dist.destroy_process_group()
    # This experiment is about the sums, not about torch's teardown: the interpreter's
    # exit with two abandoned DDP reducers sometimes ends in "terminate called without an
    # active exception" from a C++ destructor. Leave without running them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
