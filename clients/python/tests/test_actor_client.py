"""The actor client against a fake control API (http.server on 127.0.0.1).

Standard library only: python3 -m unittest discover -s clients/python/tests -v

The fake has 4 ranks and answers every call 202 (not done) first, then 200 on
the next request, so each call is polled. Methods it knows:
  echo      -> {"rank", "args", "kwargs"} per rank (pickled: a tuple)
  boom      -> rank 1 raises ValueError, the others return
  die       -> rank 2's worker is killed (WorkerDied, SIGKILL), the others ActorRestarted
  slow      -> never ends until cancelled (then CallCancelled on every rank)
  __call__  -> "called" and the args (a function actor)
"""

import base64
import io
import json
import os
import pickle
import re
import sys
import threading
import time
import unittest
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import trainlet_client  # noqa: E402
from trainlet_client import (ActorError, ActorGone, ActorRestarted, CallCancelled, Trainlet,  # noqa: E402
                             TrainletError, WorkerDied)

TOKEN = "s3cret"
WORLD = 4


def err(type_, message, ran=True, module="builtins", exit_code=None, signal=None):
    return {"type": type_, "module": module, "message": message, "ran": ran,
            "traceback": "Traceback (most recent call last):\n  File \"trainer.py\"\n%s: %s\n" % (type_, message),
            "exit_code": exit_code, "signal": signal}


class Fake:
    """The fake API's state, shared by its handler threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.actors = {}
        self.calls = {}      # (actor id, n) -> call dict
        self.requests = []   # (method, path)
        self.busy = 0        # answer this many requests 503 first
        self.seq = 0

    def outcome(self, call):
        m, args, kwargs, pickled = call["method"], call["args"], call["kwargs"], call["pickled"]
        out = []
        for rank in call["ranks"]:
            if call["cancelled"]:
                out.append({"rank": rank, "ok": False, "error": err("CallCancelled", "cancelled", module="trainlet")})
            elif m == "boom" and rank == 1:
                out.append({"rank": rank, "ok": False, "error": err("ValueError", "bad lr")})
            elif m == "die":
                if rank == 2:
                    e = err("WorkerDied", "worker died", ran=False, module="trainlet", signal="SIGKILL")
                else:
                    e = err("ActorRestarted", "round ended", ran=False, module="trainlet")
                out.append({"rank": rank, "ok": False, "error": e})
            else:
                if m == "__call__":
                    value = ["called", list(args)]
                elif pickled:
                    value = (rank, tuple(args), kwargs)
                else:
                    value = {"rank": rank, "args": args, "kwargs": kwargs}
                r = {"rank": rank, "ok": True}
                if pickled:
                    r["pickle"] = base64.b64encode(pickle.dumps(value)).decode()
                else:
                    r["value"] = value
                out.append(r)
        return out

    def answer(self, call):
        """202 the first time, then 200 with the outcome (a slow call: 202 until cancelled)."""
        call["asked"] += 1
        if call["asked"] == 1 or (call["method"] == "slow" and not call["cancelled"]):
            return 202, {"call": call["n"], "done": False}
        results = self.outcome(call)
        return 200, {"call": call["n"], "done": True, "ok": all(r["ok"] for r in results), "results": results}


class Handler(BaseHTTPRequestHandler):
    fake = None

    def log_message(self, *a):
        pass

    def reply(self, status, doc):
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def handle_any(self, method):
        f = self.fake
        u = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(u.query)
        with f.lock:
            f.requests.append((method, self.path))
        body = None
        n = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Authorization") != "Bearer " + TOKEN:
            return self.reply(401, {"message": "unauthorized"})
        if n:
            body = json.loads(self.rfile.read(n))
        with f.lock:
            if f.busy:
                f.busy -= 1
                return self.reply(503, {"message": "busy"})
        path = u.path
        if method == "POST" and path == "/v1/actors":
            if "command" in body or "target" not in body["actor"]:
                return self.reply(400, {"message": "bad body"})
            with f.lock:
                f.seq += 1
                aid = "run-%d-ab12cd" % f.seq
                f.actors[aid] = {"id": aid, "seq": f.seq, "state": "starting", "body": body, "gets": 0}
            return self.reply(201, {"id": aid, "seq": f.seq, "state": "starting"})
        m = re.fullmatch(r"/v1/actors/([^/]+)(/logs|/calls|/calls/(\d+))?", path)
        if not m or m.group(1) not in f.actors:
            return self.reply(404, {"message": "no such actor"})
        a = f.actors[m.group(1)]
        tail = m.group(2)
        with f.lock:
            if tail is None and method == "GET":
                a["gets"] += 1
                if a["state"] == "starting" and a["gets"] >= 2:
                    a["state"] = "running"
                return self.reply(200, {k: v for k, v in a.items() if k != "body"})
            if tail is None and method == "DELETE":
                a["state"] = "stopped"
                return self.reply(202, {"id": a["id"], "state": "stopping"})
        if tail == "/logs":
            self.send_response(200)
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            for rank in range(WORLD):
                self.wfile.write(("[rank%d]: hello from %s\n" % (rank, a["id"])).encode())
                self.wfile.flush()
                time.sleep(0.01)
            return
        wait = float(q.get("wait", ["30"])[0])
        with f.lock:
            if tail == "/calls" and method == "POST":
                if a["state"] in ("succeeded", "failed", "stopped"):
                    return self.reply(409, {"message": "actor is over"})
                if "pickle" in body:
                    args, kwargs = pickle.loads(base64.b64decode(body["pickle"]))
                else:
                    args, kwargs = body.get("args", []), body.get("kwargs", {})
                n = len([k for k in f.calls if k[0] == a["id"]]) + 1
                call = {"n": n, "method": body["method"], "args": args, "kwargs": kwargs,
                        "pickled": "pickle" in body, "ranks": body.get("ranks", list(range(WORLD))),
                        "cancelled": False, "asked": 0, "wait": wait}
                f.calls[(a["id"], n)] = call
            else:
                call = f.calls.get((a["id"], int(m.group(3) or 0)))
                if call is None:
                    return self.reply(404, {"message": "no such call"})
                if method == "DELETE":
                    call["cancelled"] = True
                    return self.reply(202, {"call": call["n"], "state": "cancelling"})
            status, doc = f.answer(call)
        if not doc["done"] and call["method"] == "slow":
            time.sleep(min(wait, 0.05))
        self.reply(status, doc)

    def do_GET(self):
        self.handle_any("GET")

    def do_POST(self):
        self.handle_any("POST")

    def do_DELETE(self):
        self.handle_any("DELETE")


class ActorClientTest(unittest.TestCase):
    def setUp(self):
        self.fake = Fake()
        handler = type("H", (Handler,), {"fake": self.fake})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.t = Trainlet("http://127.0.0.1:%d" % self.server.server_address[1], TOKEN)
        self.src = {"trainer.py": "class Trainer:\n    pass\n"}

    def tearDown(self):
        self.server.shutdown()
        self.server.server_close()

    def actor(self, **kw):
        return self.t.actor("trainer:Trainer", files=self.src, **kw)

    def test_create_body_wait_ready_and_close(self):
        a = self.actor(init_args=(1, 2), init_kwargs={"width": 32}, nproc_per_node=2, max_restarts=3)
        rec = self.fake.actors[a.id]
        self.assertEqual(a.record()["state"], "running")
        body = rec["body"]
        self.assertEqual(body["actor"], {"target": "trainer:Trainer", "args": [1, 2], "kwargs": {"width": 32}})
        self.assertEqual(base64.b64decode(body["files"]["trainer.py"]), self.src["trainer.py"].encode())
        self.assertEqual((body["nproc_per_node"], body["max_restarts"], body["replace"]), (2, 3, True))
        self.assertNotIn("command", body)
        a.close()
        self.assertEqual(rec["state"], "stopped")
        b = self.actor(restart="survivors")
        self.assertEqual(self.fake.actors[b.id]["body"]["actor"]["restart"], "survivors")
        b.close()
        with self.assertRaisesRegex(ValueError, "survivors"):
            self.actor(restart="some")
        self.assertIn(("DELETE", "/v1/actors/" + a.id), self.fake.requests)
        a.close()  # twice: nothing more
        self.assertEqual(self.fake.requests.count(("DELETE", "/v1/actors/" + a.id)), 1)

    def test_results_in_rank_order_rank0_and_ranks(self):
        with self.actor() as a:
            out = a.echo(1, "x", lr=0.1)
            self.assertEqual([r["rank"] for r in out], [0, 1, 2, 3])
            self.assertEqual(out[2], {"rank": 2, "args": [1, "x"], "kwargs": {"lr": 0.1}})
            self.assertEqual(a.echo.rank0(5), {"rank": 0, "args": [5], "kwargs": {}})
            self.assertEqual([r["rank"] for r in a.echo(ranks=[2, 0])], [0, 2])
            self.assertEqual([r["rank"] for r in a.echo.options(ranks=[3])()], [3])
            # every call was answered 202 first and polled until done
            polls = [p for m, p in self.fake.requests if m == "GET" and "/calls/" in p]
            self.assertTrue(all("wait=" in p for p in polls) and len(polls) == 4, polls)
        self.assertEqual(self.fake.actors[a.id]["state"], "stopped")

    def test_submit_in_parallel(self):
        a = self.actor()
        futs = [a.echo.submit(i) for i in range(8)]
        self.assertEqual([f.result(timeout=10)[0]["args"] for f in futs], [[i] for i in range(8)])
        self.assertTrue(all(f.call is not None for f in futs))
        # several threads calling at once
        out = {}

        def work(i):
            out[i] = a.echo.rank0(i)["args"]
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        self.assertEqual(out, {i: [i] for i in range(6)})
        a.close()

    def test_python_exception(self):
        a = self.actor()
        with self.assertRaises(ActorError) as cm:
            a.boom()
        e = cm.exception
        self.assertIs(type(e), ActorError)
        self.assertEqual((e.type, e.rank), ("ValueError", 1))
        self.assertEqual(len(e.results), 4)
        self.assertEqual([r for r, _ in e.failures], [1])
        self.assertTrue(e.results[0]["ok"])
        self.assertIn("rank 1", str(e))
        self.assertIn("ValueError: bad lr", str(e))
        self.assertIn("Traceback (most recent call last)", str(e))
        self.assertIn("ValueError: bad lr", e.remote_traceback)
        self.assertIsInstance(e.call, int)
        self.assertEqual(len(a.echo()), 4, "the actor is still there")
        a.close()

    def test_worker_died_is_the_root_over_actor_restarted(self):
        a = self.actor()
        with self.assertRaises(WorkerDied) as cm:
            a.die()
        e = cm.exception
        self.assertIsInstance(e, ActorError)
        self.assertNotIsInstance(e, ActorRestarted)
        self.assertEqual((e.type, e.rank), ("WorkerDied", 2))
        self.assertEqual([r for r, _ in e.failures], [0, 1, 2, 3])
        self.assertIn("SIGKILL", e.args[0])
        self.assertIn("ActorRestarted on ranks 0, 1, 3", e.args[0])
        # ranks without the dead one: the root is the first failure
        with self.assertRaises(ActorRestarted) as cm:
            a.die(ranks=[0, 1])
        self.assertEqual(cm.exception.rank, 0)
        a.close()

    def test_pickle_round_trip(self):
        a = self.actor(pickle=True, init_args=({1, 2},), init_kwargs={"blob": b"\x00"})
        spec = self.fake.actors[a.id]["body"]["actor"]
        self.assertEqual(set(spec), {"target", "pickle"})
        self.assertEqual(pickle.loads(base64.b64decode(spec["pickle"])), (({1, 2},), {"blob": b"\x00"}))
        out = a.echo({3}, b"raw", k=(1, 2))
        self.assertEqual(out[1], (1, ({3}, b"raw"), {"k": (1, 2)}))
        # per call: JSON on a pickle actor, pickle on a JSON one
        self.assertEqual(a.echo.options(pickle=False)(7)[0], {"rank": 0, "args": [7], "kwargs": {}})
        b = self.actor()
        with self.assertRaises(TypeError):
            b.echo({1})  # a set is not JSON
        self.assertEqual(b.echo.options(pickle=True).rank0({1}), (0, ({1},), {}))
        a.close()
        b.close()

    def test_start_cancel(self):
        a = self.actor()
        call = a.slow.start(1)
        self.assertFalse(call.done())
        with self.assertRaises(TimeoutError):
            call.result(timeout=0.3)
        self.assertEqual(call.cancel(), "cancelling")
        self.assertIn(("DELETE", "/v1/actors/%s/calls/%d" % (a.id, call.id)), self.fake.requests)
        with self.assertRaises(CallCancelled) as cm:
            call.result(timeout=10)
        self.assertEqual(cm.exception.type, "CallCancelled")
        # a future's remote cancel
        fut = a.slow.submit()
        deadline = time.time() + 10
        while fut.call is None and time.time() < deadline:
            time.sleep(0.01)
        fut.cancel_remote()
        with self.assertRaises(CallCancelled):
            fut.result(timeout=10)
        a.close()

    def test_function_calls___call__(self):
        f = self.t.function("trainer:train", files=self.src)
        self.assertEqual(self.fake.actors[f.id]["body"]["actor"]["target"], "trainer:train")
        self.assertEqual(f(3), [["called", [3]]] * 4)
        self.assertEqual(f.rank0(4), ["called", [4]])
        self.assertEqual(f.submit(5).result(10)[3], ["called", [5]])
        methods = {c["method"] for k, c in self.fake.calls.items() if k[0] == f.id}
        self.assertEqual(methods, {"__call__"})
        f.close()

    def test_closed_actor_and_errors(self):
        a = self.actor()
        a.close()
        with self.assertRaises(TrainletError) as cm:
            a.echo()
        self.assertEqual(cm.exception.status, 409)
        with self.assertRaises(TrainletError) as cm:
            Trainlet(self.t_url(), "wrong").actor("trainer:Trainer", files=self.src)
        self.assertEqual(cm.exception.status, 401)
        with self.assertRaises(TrainletError) as cm:
            self.t.attach("run-99-x").echo()
        self.assertEqual(cm.exception.status, 404)

    def t_url(self):
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def test_503_is_retried(self):
        self.fake.busy = 2
        a = self.actor()
        self.assertEqual(len(a.echo()), 4)
        a.close()

    def test_logs_follow_and_reserved_names(self):
        out = io.StringIO()
        a = self.actor(logs=out)
        a.close()
        self.assertIn("[rank3]: hello from " + a.id, out.getvalue())
        self.assertEqual(a.method("close").name, "close")
        self.assertEqual(a.anything.name, "anything")
        with self.assertRaises(AttributeError):
            a._private

    def test_wait_ready_reports_failure(self):
        a = self.t.actor("trainer:Trainer", files=self.src, wait_ready=False)
        rec = self.fake.actors[a.id]
        rec["state"] = "failed"
        rec["report"] = {"reason": "worker failed", "root_cause": {"message": "ImportError: no trainer"}}
        with self.assertRaises(ActorGone) as cm:
            a.wait_ready(timeout=5)
        self.assertIn("ImportError: no trainer", str(cm.exception))

    def test_cli_call(self):
        import contextlib
        import tempfile
        from trainlet_client.__main__ import main
        a = self.actor()
        with tempfile.NamedTemporaryFile("w", suffix=".token") as tok:
            tok.write(TOKEN + "\n")
            tok.flush()
            common = ["--url", self.t_url(), "--token-file", tok.name, "call", a.id]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = main(common + ["echo", "--json", "[1]", "--kwargs", '{"k": 2}', "--rank", "2"])
            self.assertEqual(rc, 0)
            self.assertEqual(json.loads(out.getvalue()),
                             [{"rank": 2, "ok": True, "value": {"rank": 2, "args": [1], "kwargs": {"k": 2}}}])
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = main(common + ["boom"])
            self.assertEqual(rc, 1)
            self.assertEqual(json.loads(out.getvalue())[1]["error"]["type"], "ValueError")
        a.close()

    def test_cli_actor_beside_and_replace(self):
        import contextlib
        import tempfile
        from trainlet_client.__main__ import main
        with tempfile.TemporaryDirectory() as src, tempfile.NamedTemporaryFile("w", suffix=".token") as tok:
            with open(os.path.join(src, "trainer.py"), "w") as f:
                f.write(self.src["trainer.py"])
            tok.write(TOKEN + "\n")
            tok.flush()
            common = ["--url", self.t_url(), "--token-file", tok.name, "actor", "trainer:Trainer", "--dir", src]
            bodies = []
            for extra in (["--beside", "--nproc-per-node", "1", "--init-kwargs", '{"width": 8}'], [],
                          ["--no-replace", "--restart", "survivors", "--init-json", "[3]"]):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    rc = main(common + extra)
                self.assertEqual(rc, 0)
                actor_id = out.getvalue().strip()
                rec = self.fake.actors[actor_id]
                self.assertEqual(rec["state"], "running")
                bodies.append(rec["body"])
            self.assertEqual((bodies[0]["replace"], bodies[0]["nproc_per_node"]), (False, 1))
            self.assertEqual(bodies[0]["actor"]["kwargs"], {"width": 8})
            self.assertEqual(base64.b64decode(bodies[0]["files"]["trainer.py"]), self.src["trainer.py"].encode())
            self.assertTrue(bodies[1]["replace"])
            self.assertEqual((bodies[2]["replace"], bodies[2]["actor"]["restart"], bodies[2]["actor"]["args"]),
                             (False, "survivors", [3]))
            with self.assertRaises(SystemExit):
                with contextlib.redirect_stderr(io.StringIO()):
                    main(common + ["--beside", "--no-replace"])

    def test_exports(self):
        for name in ("Actor", "Function", "Call", "ActorError", "WorkerDied", "ActorRestarted",
                     "ActorGone", "CallCancelled"):
            self.assertTrue(hasattr(trainlet_client, name), name)


if __name__ == "__main__":
    unittest.main()
