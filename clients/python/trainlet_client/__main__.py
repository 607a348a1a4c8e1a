"""``trainlet-client run|status|stop|logs|get|call``: the control API from a shell.

The URL and token come from ``--url``/``--token-file`` or the variables
``TRAINLET_URL`` and ``TRAINLET_TOKEN_FILE``.
"""

import argparse
import json
import os
import sys

from . import Trainlet, TrainletError


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
    c = sub.add_parser("call", help="call a method of an actor on every rank (or --rank), print the results as JSON")
    c.add_argument("actor_id")
    c.add_argument("method")
    c.add_argument("--json", default="[]", metavar="ARGS", help="the positional arguments, a JSON list")
    c.add_argument("--kwargs", default="{}", metavar="JSON", help="the keyword arguments, a JSON object")
    c.add_argument("--rank", type=int, action="append", help="call this rank only (repeatable)")
    a = p.parse_args(argv)
    if not a.token_file:
        p.error("give --token-file or TRAINLET_TOKEN_FILE")
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


if __name__ == "__main__":
    sys.exit(main())
