"""Recovery probe for `compare -- inplace` (benches/inplace_bench.rs): DDP
over gloo on every rank. Run k of KILLS (env, default 1) SIGKILLs its last
rank at step 10, after writing the time to MARK_DIR/killed.<k> (with
LOSE=pod it stops its pod's PID 1 instead: the pod is lost). Every rank
of run k >= 1 writes the time its first step ended to
MARK_DIR/first.<k>.<rank>; the last run (k = KILLS) then trains a few more
steps and exits 0. Recovery k is the last first.<k+1>.* minus killed.<k>.

A run knows its k from the `killed.*` files already written (the
launchers' restart counters differ: torchrun's is per agent, a cold pod's
starts at 0); the next run only starts after the death, so after the mark."""
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

marks = os.environ["MARK_DIR"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
kills = int(os.environ.get("KILLS", "1"))
run = 0
while run < kills and os.path.exists(f"{marks}/killed.{run}"):
    run += 1
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.ones(8, 64)
for step in range(10_000):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if run > 0 and step == 0:
        with open(f"{marks}/first.{run}.{rank}.tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(f"{marks}/first.{run}.{rank}.tmp", f"{marks}/first.{run}.{rank}")
    if run == kills and step == 5:
        break
    if run < kills and step == 10 and rank == world - 1:
        with open(f"{marks}/killed.{run}.tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(f"{marks}/killed.{run}.tmp", f"{marks}/killed.{run}")
        if os.environ.get("LOSE") == "pod":
            # The whole pod goes: its PID 1 (trainlet) is stopped, as the
            # kubelet stops a deleted or preempted pod, and takes this
            # worker with it.
            os.kill(1, signal.SIGTERM)
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
dist.destroy_process_group()
