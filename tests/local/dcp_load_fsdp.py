"""Plain FSDP2 code with torch alone (this file imports nothing of slurm_resilience):
load a DCP checkpoint of tests/local/train_fsdp_tiny.py's model, AdamW and LambdaLR
(``ckpt export --format dcp`` of a toolkit job) into a fresh FSDP2 model and optimizer
at world size WORLD with the standard recipe (``get_state_dict`` → ``dcp.load`` →
``set_state_dict``), then save them again as plain FSDP2 code does (``dcp.save``).

    python dcp_load_fsdp.py DCP_DIR WORLD OUT.pt SAVE_DIR

Rank 0 writes to OUT.pt every parameter and optimizer state entry gathered whole
(``full_tensor()``), the param groups, the scheduler's state, the checkpoint's step and
position, and each rank's local row counts of ``0.weight``. SAVE_DIR gets
``{"model", "optimizer", "scheduler"}`` written by ``dcp.save`` from the WORLD ranks.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn


def build(mesh):  # train_fsdp_tiny.py's build
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Dropout(0.1), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 2))
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def full(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def run(rank: int, world: int, port: int, path: str, out: str, save: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt, sched = build(init_device_mesh("cpu", (world,)))
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "step": -1, "position": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    msd, osd = get_state_dict(model, opt)  # what the model and optimizer now hold
    got = {"model": {k: full(v) for k, v in msd.items()},
           "optimizer": {k: {n: full(t) for n, t in per.items()} for k, per in osd["state"].items()},
           "param_groups": osd["param_groups"], "scheduler": sched.state_dict(),
           "step": state["step"], "position": state["position"]}
    rows = [None] * world
    dist.all_gather_object(rows, msd["0.weight"].to_local().shape[0])
    if save:
        dcp.save({"model": msd, "optimizer": osd, "scheduler": sched.state_dict()}, checkpoint_id=save)
    if rank == 0:
        got["scheduler"].pop("lr_lambdas", None)
        torch.save(dict(got, local_rows=rows), out)
    dist.barrier()
    os._exit(0)  # gloo's threads at interpreter exit can abort after the work is done


if __name__ == "__main__":
    path, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    save = sys.argv[4] if len(sys.argv) > 4 else ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(world, port, path, out, save), nprocs=world)
    if any(m.split(".")[0] == "slurm_resilience" for m in sys.modules):
        raise SystemExit("the DCP loader imported slurm_resilience")
