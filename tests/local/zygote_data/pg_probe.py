"""A forked rank joins a gloo process group through env:// and all-reduces its rank:
with the zygote's store host (TORCHELASTIC_USE_AGENT_STORE) every rank is a client."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"pg rank {dist.get_rank()} sum {int(t.item())} agent {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
      flush=True)
dist.destroy_process_group()
