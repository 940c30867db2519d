"""The least a careful script does to take one DDP step (benchmarks/startup.py's baseline): import torch,
join gloo, wrap the quick start's 64→1024→10 MLP in DDP, one step on a batch of 64, leave the group.
Run under torchrun: `torchrun --nproc-per-node 2 benchmarks/startup_bare.py`."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
loss = nn.functional.cross_entropy(model(x), y)
loss.backward()
optimizer.step()
if dist.get_rank() == 0:
    print(f"step 1 | loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
