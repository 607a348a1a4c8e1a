"""First-step probe for the serve and preload benchmarks (serve_bench.rs).

Each rank writes the wall-clock time (ns) at which its first DDP training
step finished to $STEP_DIR/<tag>_<rank>, where tag is `first` for the
first attempt and `again` for a restarted one. With CRASH=1, rank 0 dies
right after its first step in the first attempt (writing the crash time).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

d = os.environ["STEP_DIR"]
restarted = os.path.exists(os.path.join(d, "crash"))
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(32, 64)).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
now = time.time_ns()
tag = "again" if restarted else "first"
with open(os.path.join(d, "%s_%d.tmp" % (tag, rank)), "w") as f:
    f.write(str(now))
os.rename(os.path.join(d, "%s_%d.tmp" % (tag, rank)), os.path.join(d, "%s_%d" % (tag, rank)))
if os.environ.get("CRASH") == "1" and not restarted and rank == 0:
    with open(os.path.join(d, "crash.tmp"), "w") as f:
        f.write(str(time.time_ns()))
    os.rename(os.path.join(d, "crash.tmp"), os.path.join(d, "crash"))
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
# End without finalizing: torch 2.15's gloo threads can abort a finalizing
# interpreter (see exit_now in examples/train_ddp.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
