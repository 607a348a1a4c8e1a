"""Warm pods from the driver, timed (benches/driver_bench.rs): this script's
start -> trainlet_client.up (2 pods x 2 workers on trainlet-dev) -> an actor
of a class of this __main__ -> its first call answered on every rank; then a
second process's connect -> its first call answered; then down. Prints one
JSON line: {"first_call": s, "reconnect": s}.

usage: driver_start.py KUBECONFIG NAMESPACE PATCHES_JSON NAME
"""
import time

STARTED = time.monotonic()

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
import trainlet_client as tc  # noqa: E402

kubeconfig, namespace, patches, name = sys.argv[1:5]


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n


with tc.up(name, nodes=2, nproc_per_node=2, env={"PYTHONPATH": "/opt/torch"}, patches=json.loads(patches),
           kubeconfig=kubeconfig, namespace=namespace, timeout=300, progress=None) as t:
    a = t.actor(Counter)
    assert a.add(1) == [1, 1, 1, 1]
    first = time.monotonic() - STARTED
    code = ("import json, sys, time; sys.path.insert(0, %r); import trainlet_client as tc\n"
            "s = time.monotonic(); t = tc.connect(%r, kubeconfig=%r, namespace=%r, progress=None)\n"
            "v = t.attach(%r).add.rank0(1); print(json.dumps({'seconds': time.monotonic() - s, 'value': v}))\n"
            % (sys.path[0], name, kubeconfig, namespace, a.id))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    second = json.loads(p.stdout.strip().splitlines()[-1])
    assert second["value"] == 2, second
print(json.dumps({"first_call": first, "reconnect": second["seconds"]}))
