"""``trainlet-client run|status|stop|logs|get|actor|call``: the control API from a shell;
``trainlet-client up|connect|down|ls``: warm pods on a cluster (the ``k8s`` extra).

The URL and token come from ``--url``/``--token-file`` or the variables
``TRAINLET_URL`` and ``TRAINLET_TOKEN_FILE``; with ``--job NAME`` (or
``TRAINLET_JOB``) the commands reach warm pods brought up by ``up`` through the
Kubernetes API instead.
"""

import argparse
import json
import os
import sys

from . import Trainlet, TrainletError
from . import cluster as _cluster


def main(argv=None):
    p = argparse.ArgumentParser(prog="trainlet-client")
    p.add_argument("--url", default=os.environ.get("TRAINLET_URL", "http://127.0.0.1:29400"))
    p.add_argument("--token-file", default=os.environ.get("TRAINLET_TOKEN_FILE"))
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="submit a run and stream its lines")
    r.add_argument("--dir", help="directory whose files the run gets (its working directory)")
    r.add_argument("--env", action="append", default=[], metavar="K=V")
    r.add_argument("--nproc-per-node", type=int)
    r.add_argument("--max-restarts", type=int)
    r.add_argument("--replace", action="store_true")
    r.add_argument("--detach", action="store_true", help="print the run id and return")
    r.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("status")
    for name in ("stop", "logs", "get"):
        s = sub.add_parser(name)
        s.add_argument("run_id")
        if name == "logs":
            s.add_argument("-f", "--follow", action="store_true")
    ac = sub.add_parser("actor", help="deploy an actor: every worker instantiates TARGET once; "
                        "print its id once it runs (then: call ID METHOD, stop ID)")
    ac.add_argument("target", help="pkg.module:Name, importable from --dir")
    ac.add_argument("--dir", help="directory whose files the actor's workers get")
    ac.add_argument("--init-json", default="[]", metavar="ARGS", help="the class's positional arguments, a JSON list")
    ac.add_argument("--init-kwargs", default="{}", metavar="JSON", help="its keyword arguments, a JSON object")
    ac.add_argument("--env", action="append", default=[], metavar="K=V")
    ac.add_argument("--nproc-per-node", type=int)
    ac.add_argument("--max-restarts", type=int)
    ac.add_argument("--restart", choices=("all", "survivors"), default="all",
                    help="what a dead worker restarts: every rank, or only the missing ones")
    place = ac.add_mutually_exclusive_group()
    place.add_argument("--beside", action="store_true",
                       help="run beside what runs, in slots nobody holds (409 naming the holder when taken)")
    place.add_argument("--no-replace", action="store_true",
                       help="refuse (409) when the pods run something, instead of stopping it")
    ac.add_argument("--ready-timeout", type=float, default=300.0)
    c = sub.add_parser("call", help="call a method of an actor on every rank (or --rank), print the results as JSON")
    c.add_argument("actor_id")
    c.add_argument("method")
    c.add_argument("--json", default="[]", metavar="ARGS", help="the positional arguments, a JSON list")
    c.add_argument("--kwargs", default="{}", metavar="JSON", help="the keyword arguments, a JSON object")
    c.add_argument("--rank", type=int, action="append", help="call this rank only (repeatable)")
    p.add_argument("--job", default=os.environ.get("TRAINLET_JOB"),
                   help="warm pods brought up by `up` (reached through the Kubernetes API)")
    p.add_argument("--namespace", "-n", help="the warm pods' namespace (default: the kubeconfig's)")
    p.add_argument("--kubeconfig")
    p.add_argument("--context", help="the kubeconfig's context (default: its current one)")
    u = sub.add_parser("up", help="bring up warm pods (a TrainJob) and wait until they are ready")
    u.add_argument("name")
    u.add_argument("--nodes", type=int, default=1)
    u.add_argument("--nproc-per-node", type=int, default=1)
    u.add_argument("--runtime", default="trainlet-dev")
    u.add_argument("--image")
    u.add_argument("--gpus", type=int, help="nvidia.com/gpu per pod")
    u.add_argument("--env", action="append", default=[], metavar="K=V")
    u.add_argument("--ttl", type=int, help="seconds idle after which the pods end")
    u.add_argument("--timeout", type=float, default=600.0)
    u.add_argument("--patch", action="append", default=[], metavar="JSON",
                   help="a runtimePatches entry of the TrainJob (Trainer's API), a JSON object (repeatable)")
    sub.add_parser("connect", help="check that warm pods --job answer").add_argument("name")
    sub.add_parser("down", help="delete warm pods: the TrainJob, its Secret, its pods").add_argument("name")
    sub.add_parser("ls", help="list warm pods in the namespace")
    a = p.parse_args(argv)
    where = dict(namespace=a.namespace, kubeconfig=a.kubeconfig, context=a.context)
    try:
        if a.cmd in ("up", "connect", "down", "ls"):
            return cluster_command(a, where)
    except (_cluster.UpError, ImportError) as e:
        print("trainlet-client: %s" % e, file=sys.stderr)
        return 2
    if a.job:
        try:
            t = _cluster.connect(a.job, progress=None, **where)
        except (_cluster.UpError, ImportError) as e:
            print("trainlet-client: %s" % e, file=sys.stderr)
            return 2
    else:
        if not a.token_file:
            p.error("give --token-file or TRAINLET_TOKEN_FILE (or --job NAME for warm pods on a cluster)")
        with open(a.token_file) as f:
            t = Trainlet(a.url, f.read())
    try:
        if a.cmd == "run":
            if not a.command:
                p.error("run needs a command, e.g. run -- python train.py")
            cmd = a.command[1:] if a.command[0] == "--" else a.command
            env = dict(kv.split("=", 1) for kv in a.env)
            kw = dict(files=a.dir, env=env, nproc_per_node=a.nproc_per_node,
                      max_restarts=a.max_restarts, replace=a.replace, archive=a.dir is not None)
            if a.detach:
                print(t.submit(cmd, **kw))
                return 0
            res = t.run(cmd, **kw)
            print("run %s %s" % (res.id, res.state), file=sys.stderr)
            return 0 if res.ok else 1
        if a.cmd == "status":
            print(json.dumps(t.status(), indent=2))
        elif a.cmd == "stop":
            print(t.stop(a.run_id))
        elif a.cmd == "get":
            print(json.dumps(t.get(a.run_id).record, indent=2))
        elif a.cmd == "actor":
            args, kwargs = json.loads(a.init_json), json.loads(a.init_kwargs)
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                p.error("--init-json takes a JSON list, --init-kwargs a JSON object")
            env = dict(kv.split("=", 1) for kv in a.env)
            actor = t.actor(a.target, files=a.dir, init_args=args, init_kwargs=kwargs, env=env,
                            nproc_per_node=a.nproc_per_node, max_restarts=a.max_restarts,
                            replace=not a.no_replace, beside=a.beside, restart=a.restart,
                            ready_timeout=a.ready_timeout)
            print(actor.id)
        elif a.cmd == "call":
            args, kwargs = json.loads(a.json), json.loads(a.kwargs)
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                p.error("--json takes a JSON list, --kwargs a JSON object")
            doc = t.attach(a.actor_id).method(a.method).options(ranks=a.rank)._start(args, kwargs, None, 30).wait()
            print(json.dumps(doc["results"], indent=2))
            return 0 if doc.get("ok") else 1
        elif a.cmd == "logs":
            for line in t.logs(a.run_id, follow=a.follow):
                print(line)
        return 0
    except TrainletError as e:
        print("trainlet-client: %s" % e, file=sys.stderr)
        return 2


def cluster_command(a, where):
    if a.cmd == "up":
        env = dict(kv.split("=", 1) for kv in a.env)
        resources = {"limits": {"nvidia.com/gpu": a.gpus}} if a.gpus else None
        patches = []
        for text in a.patch:
            try:
                patch = json.loads(text)
            except ValueError as e:
                raise _cluster.UpError("--patch %.60r is not JSON: %s" % (text, e)) from None
            if not isinstance(patch, dict):
                raise _cluster.UpError("--patch takes one runtimePatches entry, a JSON object; got %.60r" % text)
            patches.append(patch)
        t = _cluster.up(a.name, nodes=a.nodes, nproc_per_node=a.nproc_per_node, runtime=a.runtime,
                        image=a.image, resources=resources, env=env, ttl=a.ttl, keep=True,
                        timeout=a.timeout, patches=patches or None, **where)
        t.close()
        print(a.name)
    elif a.cmd == "connect":
        _cluster.connect(a.name, **where).close()
        print(a.name)
    elif a.cmd == "down":
        _cluster.down(a.name, **where)
    elif a.cmd == "ls":
        for j in _cluster.ls(**where):
            idle = "-" if j["idle_seconds"] is None else "%ds" % j["idle_seconds"]
            print("%-24s %-10s %s/%s ready  idle %s" % (j["name"], j["state"], j["ready"], j["nodes"], idle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
