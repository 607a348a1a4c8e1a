"""An actor for examples/actor_driver.py: a tiny DDP model (CPU, gloo) that
every worker of every pod instantiates once and keeps between calls.

The driver calls setup(lr), train(steps), state() and evaluate(); each runs
on every rank at once (DDP's collectives need them all), and the model, the
optimizer and the step count stay in memory between calls. With
restart="survivors", reconfigure() is called on the ranks that outlive a
dead one (see docs/src/actors.md#survivors-mode); crash() kills one rank.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Trainer:
    def __init__(self, width=32, seed=0):
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.model = DDP(self.net)
        self.shard()
        self.opt = None
        self.steps = 0

    def shard(self):
        """This rank's part of a fixed data set (1,024 samples in all)."""
        g = torch.Generator().manual_seed(1234)
        true_w = torch.randn(16, 1, generator=g)
        x = torch.randn(1024, 16, generator=g)
        y = x @ true_w + 0.01 * torch.randn(1024, 1, generator=g)
        self.x, self.y = x[self.rank :: self.world], y[self.rank :: self.world]

    def reconfigure(self, rank, world_size):
        """Survivors mode: the process group is new (a rank was replaced).
        Wrapping the model again broadcasts rank 0's parameters to the fresh ranks."""
        self.rank, self.world = rank, world_size
        self.model = DDP(self.net)
        self.shard()

    def crash(self, rank):
        """Kill this worker's process if it is `rank` (to show a recovery)."""
        if self.rank == rank:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        return self.rank

    def setup(self, lr=0.05):
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        return {"rank": self.rank, "world": self.world, "lr": lr}

    def train(self, steps=10):
        if self.opt is None:
            raise RuntimeError("call setup(lr) first")
        if steps < 1:
            raise ValueError("steps must be at least 1, got %r" % (steps,))
        for _ in range(steps):
            self.opt.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
            loss.backward()
            self.opt.step()
            self.steps += 1
        print(f"rank {self.rank}: step {self.steps} loss {loss.item():.4f}", flush=True)
        return {"loss": loss.item(), "steps": self.steps}

    def state(self):
        """This rank's step count and a checksum of its parameters (DDP keeps them identical)."""
        checksum = sum(p.detach().double().sum().item() for p in self.model.parameters())
        return {"rank": self.rank, "steps": self.steps, "checksum": round(checksum, 9)}

    def evaluate(self):
        """The loss over every rank's shard (all-reduced, so every rank returns the same)."""
        with torch.no_grad():
            total = torch.nn.functional.mse_loss(self.model(self.x), self.y, reduction="sum")
            n = torch.tensor([float(len(self.x))])
            both = torch.stack([total, n[0]])
            dist.all_reduce(both)
        return {"loss": (both[0] / both[1]).item()}
