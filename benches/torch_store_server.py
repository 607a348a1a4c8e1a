"""torch's own libuv TCPStore server on a free port: prints the port, serves
until stdin closes. The reference side of the store-init benchmark."""
import resource
import sys

import torch.distributed as dist

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
print(s.port, flush=True)
sys.stdin.read()
