"""Store throughput with real torch.distributed.TCPStore clients: the same
client loop against trainlet's store (port in argv[1]) and torch's own libuv
server (torch_store_server.py, its own process). Prints one JSON object of
ops/s per operation and server."""
import json
import os
import subprocess
import sys
import time

import torch.distributed as dist

N = int(sys.argv[2]) if len(sys.argv) > 2 else 3000


def rates(port):
    c = dist.TCPStore("127.0.0.1", port, is_master=False)
    out = {}
    for name, op in [
        ("set", lambda i: c.set(f"k{i}", "v" * 64)),
        ("get", lambda i: c.get(f"k{i}")),
        ("add", lambda i: c.add("counter", 1)),
        ("check", lambda i: c.check([f"k{i}"])),
        ("multi_get_8", lambda i: c.multi_get([f"k{(i + j) % N}" for j in range(8)])),
    ]:
        t = time.perf_counter()
        for i in range(N):
            op(i)
        c.num_keys()  # round trip: every fire-and-forget SET has been processed
        out[name] = N / (time.perf_counter() - t)
    return out


# torch's server runs in a process of its own, as trainlet's does: hosted
# in this client's process it skipped a process switch per round trip, and
# on a loaded machine the two sides no longer compared like with like.
server = subprocess.Popen(
    [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_store_server.py")],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
)
torch_port = int(server.stdout.readline())
best = {"trainlet": {}, "torch": {}}
try:
    for _ in range(3):  # interleave, keep the best of each
        for name, port in (("trainlet", int(sys.argv[1])), ("torch", torch_port)):
            for op, r in rates(port).items():
                best[name][op] = max(best[name].get(op, 0.0), r)
finally:
    server.stdin.close()
    server.wait()
print(json.dumps(best))
