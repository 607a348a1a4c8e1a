"""Driver of the actor benchmarks (actor_bench.rs), with the repository's
Python client (clients/python), against served pods already started.

usage: actor_driver.py URL TOKEN_FILE TRAINER_PY CALLS REDEPLOYS RECOVERIES SURVIVORS

Deploys tests/fixtures/actor_trainer.py's Trainer (2 workers per pod), then
prints one JSON line per measurement, every time in seconds:

- {"calls": [...], "status": [...]}: CALLS no-op calls (`noop()` on every
  rank, the client's call: a new connection, POST .../calls?wait=30, every
  rank's result) and as many `GET /v1/status` round trips with the same
  client (the HTTP floor), interleaved, after 20 of each to warm up;
- {"redeploy": [...]}: REDEPLOYS times a changed actor (another `lr`)
  posted -> its first call (`train(1)`: one DDP step on every rank)
  answered; the previous actor is closed and the pods idle first, untimed,
  as in the serve redeploy row;
- {"recovery": [...]}: RECOVERIES times `die(3)` posted (rank 3 SIGKILLs
  itself) -> the next call (`state()`) answered by every rank after every
  rank re-instantiated the actor;
- {"survivors": [...]}: SURVIVORS times the same with an actor deployed
  with restart="survivors": only rank 3 is instantiated again, ranks 0-2
  keep their processes and rejoin the new process group.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "clients", "python"))
from trainlet_client import ActorError, Trainlet  # noqa: E402

url, token_file, trainer = sys.argv[1:4]
n_calls, n_redeploy, n_recovery, n_survivors = (int(a) for a in sys.argv[4:8])
with open(token_file) as f:
    t = Trainlet(url, f.read())
files = {"actor_trainer.py": open(trainer).read()}
TARGET = "actor_trainer:Trainer"


def out(**kw):
    print(json.dumps(kw), flush=True)


def wait_api():
    deadline = time.monotonic() + 60
    while True:
        try:
            return t._request("GET", "/v1/status")
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_idle(limit=120):
    deadline = time.monotonic() + limit
    while t._request("GET", "/v1/status").get("active") is not None:
        if time.monotonic() > deadline:
            raise TimeoutError("the pods did not go idle")
        time.sleep(0.02)


def deploy(lr, wait_ready, restart="all"):
    return t.actor(TARGET, files=files, init_kwargs={"lr": lr}, nproc_per_node=2, max_restarts=100,
                   replace=False, wait_ready=wait_ready, restart=restart)


def recoveries(a, n):
    """n times: die(3) -> state() answered by every rank, in seconds."""
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            a.die(3)
            raise AssertionError("die(3) answered")
        except ActorError as e:
            assert e.type == "WorkerDied" and e.rank == 3, (e.type, e.rank, str(e))
        states = a.state()
        took.append(time.perf_counter() - t0)
        assert [s["rank"] for s in states] == [0, 1, 2, 3], states
    return took, states


wait_api()
a = deploy(0.1, True)
a.train(1)  # the first DDP step (lazy imports) is not part of the call overhead

if n_calls:
    for _ in range(20):
        a.noop()
        t._request("GET", "/v1/status")
    calls, status = [], []
    for _ in range(n_calls):
        t0 = time.perf_counter()
        values = a.noop()
        t1 = time.perf_counter()
        t._request("GET", "/v1/status")
        t2 = time.perf_counter()
        assert values == [None] * 4, values
        calls.append(t1 - t0)
        status.append(t2 - t1)
    out(calls=calls, status=status)

took = []
for i in range(n_redeploy):
    a.close()
    wait_idle()
    t0 = time.perf_counter()
    a = deploy(0.1 + 0.01 * (i + 1), False)
    states = a.train(1)
    took.append(time.perf_counter() - t0)
    assert [s["steps"] for s in states] == [1] * 4, states
if n_redeploy:
    out(redeploy=took)

if n_recovery:
    out(recovery=recoveries(a, n_recovery)[0])
if n_survivors:
    a.close()
    wait_idle()
    a = deploy(0.1, True, "survivors")
    before = a.train(1)
    took, states = recoveries(a, n_survivors)
    assert [s["pid"] for s in states[:3]] == [s["pid"] for s in before[:3]], (before, states)
    assert [s["reconfigured"] for s in states] == [n_survivors] * 3 + [0], states
    out(survivors=took)
a.close()
