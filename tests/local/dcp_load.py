"""Load a DCP checkpoint exported by ``ckpt export`` with torch alone (this file imports
nothing of slurm_resilience): into a fresh examples/train_zero.py model and momentum
vector, at world size 1 (one process) or 2 (two gloo processes, the model sharded by
FSDP2 ``fully_shard``, the momentum a DTensor ``Shard(0)``; DCP reshards on load).

    python dcp_load.py DCP_DIR WORLD OUT.pt

Rank 0 writes the loaded tensors, gathered whole, and each rank's local sizes to OUT.pt.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

MOMENTUM = 32 * 64 + 64 + 64 * 4 + 4  # train_zero.py's parameter count


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def load_single(path: str, out: str) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    m = model()
    state = {"model": m.state_dict(), "optimizer": {"shards": {"momentum": torch.zeros(MOMENTUM)}},
             "step": -1, "position": -1}
    dcp.load(state, checkpoint_id=path)
    m.load_state_dict(state["model"])
    torch.save({"model": m.state_dict(), "momentum": state["optimizer"]["shards"]["momentum"],
                "step": state["step"], "position": state["position"], "local": [MOMENTUM]}, out)


def load_sharded(rank: int, world: int, port: int, path: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    m = fully_shard(model(), mesh=mesh)
    msd = get_model_state_dict(m)
    mom = distribute_tensor(torch.zeros(MOMENTUM), mesh, [Shard(0)])
    state = {"model": msd, "optimizer": {"shards": {"momentum": mom}}, "step": -1, "position": -1}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(m, state["model"])
    local = [mom.to_local().numel()]
    sizes = [None] * world
    dist.all_gather_object(sizes, local)
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    momentum = mom.full_tensor()
    if rank == 0:
        torch.save({"model": full, "momentum": momentum, "step": state["step"], "position": state["position"],
                    "local": [s[0] for s in sizes]}, out)
    dist.barrier()
    # leave without torch's C++ destructors: gloo's threads at interpreter exit can
    # abort ("terminate called without an active exception") after the work is done
    os._exit(0)


if __name__ == "__main__":
    path, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    if world == 1:
        load_single(path, out)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(load_sharded, args=(world, port, path, out), nprocs=world)
    if any(m.split(".")[0] == "slurm_resilience" for m in sys.modules):
        raise SystemExit("the DCP loader imported slurm_resilience")
