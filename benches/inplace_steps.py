"""Recovery probe for `compare -- inplace` (benches/inplace_bench.rs): DDP
over gloo on every rank; the last rank SIGKILLs itself at step 10 of the
first run, after writing the time to MARK_DIR/killed. Every rank of a later
run writes the time its first step ended to MARK_DIR/first.<rank>, trains
a few more steps and exits 0.

The first run is told apart by the `killed` file (the launchers' restart
counters differ: torchrun's is per agent, a cold pod's starts at 0)."""
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

marks = os.environ["MARK_DIR"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
recovered = os.path.exists(f"{marks}/killed")
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.ones(8, 64)
for step in range(10_000):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if recovered:
        if step == 0:
            with open(f"{marks}/first.{rank}.tmp", "w") as f:
                f.write(repr(time.time()))
            os.rename(f"{marks}/first.{rank}.tmp", f"{marks}/first.{rank}")
        if step == 5:
            break
    elif step == 10 and rank == world - 1:
        with open(f"{marks}/killed.tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(f"{marks}/killed.tmp", f"{marks}/killed")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
dist.destroy_process_group()
