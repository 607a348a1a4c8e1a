"""A small DDP training job on synthetic data (CPU, gloo): trainlet's main job.

Each rank trains the same tiny MLP on its shard of a deterministic synthetic
regression problem and prints the loss. With --check, rank 0 gathers every
rank's parameters and exits non-zero unless all are identical.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--check", action="store_true", help="verify identical parameters on all ranks")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(1234)
    true_w = torch.randn(16, 1, generator=g)
    x = torch.randn(256 * world, 16, generator=g)
    y = x @ true_w + 0.01 * torch.randn(256 * world, 1, generator=g)
    xs, ys = x[rank::world], y[rank::world]

    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"rank {rank}/{world} step {step} loss {loss.item():.4f}", flush=True)

    if args.check:
        flat = torch.cat([q.detach().flatten() for q in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        same = all(torch.equal(gathered[0], t) for t in gathered)
        if rank == 0:
            print(f"parameters identical on all {world} ranks: {same}", flush=True)
        if not same:
            return 1
    dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Ends the process without finalizing the interpreter.

    torch 2.15's gloo process group keeps its worker threads until the
    interpreter shuts down (destroy_process_group does not stop them). A
    thread still freeing the last collective's tensors then takes the GIL of
    a finalizing interpreter, and the process aborts (SIGABRT, "terminate
    called without an active exception") after the job succeeded. torchrun
    hits it as well, more often on a loaded machine. os._exit skips that
    shutdown; nothing is left to flush but the standard streams.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
