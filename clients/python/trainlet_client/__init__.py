"""Client for trainlet's control API (``trainlet run --serve``).

Standard library only (``http.client``). One object per job::

    from trainlet_client import Trainlet
    t = Trainlet("http://127.0.0.1:29400", token=open("token").read())
    result = t.run(["python", "train.py"], files="./src", follow=True)
    print(result.state, result.exit_codes)

``files`` is a directory (every regular file under it, by relative path)
or a mapping of relative path to ``bytes``/``str``. Unchanged files are
not re-sent to the other pods (trainlet stores them by content).

Actors (``t.actor(...)``, ``t.function(...)``: a class instantiated once on
every worker, whose methods the driver calls) are in :mod:`.actor`.
"""

import base64
import http.client
import json
import os
import sys
import time
import urllib.parse

__all__ = ["Trainlet", "Result", "TrainletError", "Actor", "Function", "Method", "Call", "CallFuture",
           "CallTimeout", "ActorError", "WorkerDied", "ActorRestarted", "ActorGone", "CallCancelled",
           "up", "connect", "down", "ls", "Warm", "UpError"]

FINAL = ("succeeded", "failed", "stopped")


class TrainletError(Exception):
    """The control API refused a request: ``status`` and its ``message``."""

    def __init__(self, status, message):
        super().__init__("HTTP %d: %s" % (status, message))
        self.status = status
        self.message = message


class Result:
    """A run as the control API reports it (``GET /v1/runs/{id}``)."""

    def __init__(self, record):
        self.record = record
        self.id = record["id"]
        self.state = record["state"]
        self.ranks = record.get("ranks", [])
        self.report = record.get("report")
        self.timings = record.get("timings", {})

    @property
    def exit_codes(self):
        """Rank -> exit code (None: stopped before it exited)."""
        return {r["rank"]: r["exit_code"] for r in self.ranks}

    @property
    def ok(self):
        return self.state == "succeeded"

    def __repr__(self):
        return "Result(id=%r, state=%r)" % (self.id, self.state)


def _collect(files):
    if files is None:
        return {}
    if isinstance(files, (str, os.PathLike)):
        root = os.fspath(files)
        out = {}
        for dirpath, dirnames, names in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".git"))
            for name in sorted(names):
                full = os.path.join(dirpath, name)
                if os.path.islink(full) or not os.path.isfile(full):
                    continue
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                with open(full, "rb") as f:
                    out[rel] = f.read()
        return out
    return {k: (v.encode() if isinstance(v, str) else bytes(v)) for k, v in files.items()}


def _targz(files):
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Trainlet:
    """The control API at ``url`` (``http://host:port``) with bearer ``token``."""

    def __init__(self, url, token, timeout=60.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "") or not u.hostname:
            raise ValueError("url must be http://host:port, got %r" % url)
        self.host = u.hostname
        self.port = u.port or 29400
        self.token = token.strip()
        self.timeout = timeout

    def _conn(self, timeout=None):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def _request(self, method, path, body=None, archive=None, timeout=None):
        """One request on a new connection; a 503 (the API is saturated) is retried
        a few times after a short sleep."""
        for delay in (0.2, 0.5, 1.0, 2.0, None):
            try:
                return self._request_once(method, path, body, archive, timeout)
            except TrainletError as e:
                if e.status != 503 or delay is None:
                    raise
                time.sleep(delay)

    def _request_once(self, method, path, body, archive, timeout):
        c = self._conn(timeout)
        try:
            headers = {"Authorization": "Bearer " + self.token}
            data = None
            if archive is not None:
                data = archive
                headers["Content-Type"] = "application/gzip"
                headers["X-Trainlet-Run"] = json.dumps(body)
            elif body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            c.request(method, path, body=data, headers=headers)
            r = c.getresponse()
            raw = r.read()
            try:
                doc = json.loads(raw) if raw else {}
            except ValueError:
                doc = {"message": raw.decode(errors="replace")}
            if r.status >= 400:
                raise TrainletError(r.status, doc.get("message", r.reason))
            return doc
        finally:
            c.close()

    def submit(self, command, args=None, env=None, files=None, nproc_per_node=None, max_restarts=None,
               replace=False, archive=False):
        """Start a run on every pod; returns its id. With ``archive`` the files
        go as one tar.gz body (smaller than base64 JSON for many files)."""
        collected = _collect(files)
        body = {
            "command": list(command),
            "args": list(args or []),
            "env": dict(env or {}),
            "replace": bool(replace),
        }
        if not archive:
            body["files"] = {k: base64.b64encode(v).decode() for k, v in collected.items()}
        if nproc_per_node is not None:
            body["nproc_per_node"] = int(nproc_per_node)
        if max_restarts is not None:
            body["max_restarts"] = int(max_restarts)
        tar = _targz(collected) if archive else None
        return self._request("POST", "/v1/runs", body, archive=tar)["id"]

    def get(self, run_id):
        """The run's record."""
        return Result(self._request("GET", "/v1/runs/" + urllib.parse.quote(run_id)))

    def stop(self, run_id):
        """Stop the run (checkpoint signal, grace); returns its state."""
        return self._request("DELETE", "/v1/runs/" + urllib.parse.quote(run_id))["state"]

    def status(self):
        """Pods, world and runs."""
        return self._request("GET", "/v1/status")

    def stacks(self):
        """Every rank's stacks now, read from outside the workers by their pods' agents:
        ``{"pods", "answered", "stall": {"stalled_ranks", "waiting_ranks", "unknown_ranks",
        "summary"}, "ranks": [{"rank", "local_rank", "node_rank", "host", "stacks": {"pid",
        "python", "threads": [{"tid", "name", "main", "python": [{"function", "file",
        "line"}], "native", "kernel"}], "note", "took_ms"}}], "lanes": [{"run", "stall",
        "ranks"}]}``; ``lanes`` are the actors beside the main run, each judged apart."""
        return self._request("GET", "/v1/stacks")

    def runs(self):
        """Every run and actor the control API keeps (the newest 64), each as a dict."""
        return self._request("GET", "/v1/runs")["runs"]

    def logs(self, run_id, follow=False):
        """Yield the run's lines (every rank's, prefixed); with ``follow``, until it ends."""
        return self._lines("/v1/runs/%s/logs" % urllib.parse.quote(run_id), follow)

    def _lines(self, path, follow):
        c = self._conn(timeout=None if follow else self.timeout)
        try:
            q = "?follow=true" if follow else ""
            c.request("GET", path + q, headers={"Authorization": "Bearer " + self.token})
            r = c.getresponse()
            if r.status >= 400:
                raw = r.read()
                try:
                    msg = json.loads(raw).get("message", r.reason)
                except ValueError:
                    msg = r.reason
                raise TrainletError(r.status, msg)
            pending = b""
            while True:
                chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
            if pending:
                yield pending.decode(errors="replace")
        finally:
            c.close()

    def wait(self, run_id, timeout=None, poll=0.2):
        """The run's record once it is over."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            res = self.get(run_id)
            if res.state in FINAL:
                return res
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("run %s still %s after %ss" % (run_id, res.state, timeout))
            time.sleep(poll)

    def run(self, command, follow=True, out=None, **kw):
        """Submit, stream the lines to ``out`` (stdout) while it runs, and return its :class:`Result`."""
        run_id = self.submit(command, **kw)
        if follow:
            out = out or sys.stdout
            for line in self.logs(run_id, follow=True):
                out.write(line + "\n")
                out.flush()
        return self.wait(run_id)

    def actor(self, target, files=None, init_args=(), init_kwargs=None, nproc_per_node=None, env=None,
              max_restarts=None, replace=True, pickle=False, wait_ready=True, logs=None, ready_timeout=300.0,
              restart="all", beside=False):
        """Deploy ``target`` (``"pkg.module:Name"``, importable from ``files``, or the class
        itself): every worker of every pod instantiates ``Name(*init_args, **init_kwargs)`` once.
        Returns an :class:`Actor` whose attributes are the remote methods (``a.train(steps=10)``).

        A class defined in ``__main__`` (the script, a notebook cell) travels by value: its source
        and what it uses from ``__main__`` (functions, classes, modules by name, other values
        pickled) become a module sent with ``files`` (see :mod:`trainlet_client.ship`, which
        says what cannot travel). A class of an importable module is imported by its name.

        ``replace`` stops the pods' main run or actor first (else 409). ``beside=True`` runs it
        beside what runs instead (``replace`` is then ignored): its ``nproc_per_node`` workers
        on every pod in slots nobody holds, its own process group and GPUs, its calls
        independent of the others'; 409 naming what holds the slots when they are taken.
        ``pickle`` sends the init
        arguments and every call's arguments pickled, and gets the results pickled (only with pods
        you trust; JSON by default). ``wait_ready`` waits (up to ``ready_timeout`` s) until it is
        running. ``logs``: a file object (``sys.stdout``) every rank's lines are copied to, by a
        background thread, until it is closed.

        ``restart`` says what a worker's death or a lost pod restarts: ``"all"`` (every rank is
        instantiated again) or ``"survivors"`` (only the missing ranks start afresh; the live
        workers keep their process and state, join the new process group, and have their
        ``reconfigure(rank, world_size)`` method called, where DDP is wrapped again)."""
        return _actor.create(self, Actor, target, files, init_args, init_kwargs, nproc_per_node, env,
                             max_restarts, replace and not beside, pickle, wait_ready, logs, ready_timeout,
                             restart)

    def function(self, target, files=None, **kw):
        """Deploy a plain function (``"pkg.module:fn"``, or the function itself, shipped as
        :meth:`actor` ships a class) as a one-method actor: ``f(...)`` calls it
        on every rank (a list, rank order), ``f.rank0(...)`` returns rank 0's value. Same
        keywords as :meth:`actor`, without ``init_args``/``init_kwargs``."""
        return _actor.create(self, Function, target, files, **kw)

    def declare_setup(self, pip=None, bash=None, env=None, steps=None):
        """Record setup steps every pod applies once, in order, before its next run or actor
        (and a pod that joins later, before anything): ``env`` (variables for the later steps
        and every worker), then ``pip`` (one ``pip install --target`` of these arguments, into
        a directory the workers' ``sys.path`` and ``PATH`` include), then each ``bash`` script.
        ``steps`` gives them in any order instead: ``[{"pip": [...]}, {"bash": "..."},
        {"env": {...}}]``. Declaring them again replays from the first changed step only."""
        if steps is None:
            steps = []
            if env:
                steps.append({"env": dict(env)})
            if pip:
                steps.append({"pip": [pip] if isinstance(pip, str) else list(pip)})
            for b in ([bash] if isinstance(bash, str) else list(bash or [])):
                steps.append({"bash": b})
        self._request("POST", "/v1/setup", {"steps": list(steps)})
        return steps

    def setup(self, pip=None, bash=None, env=None, steps=None, out=None, replace=False):
        """Declare setup steps (see :meth:`declare_setup`) and apply them on every pod now: a
        one-worker run that does nothing, started after them, whose log carries each pod's
        ``[setup]`` lines. Raises :class:`TrainletError` naming the pod and the step when one
        fails; ``replace`` stops an active run or actor first (else 409)."""
        self.declare_setup(pip=pip, bash=bash, env=env, steps=steps)
        res = self.run(["python", "-c", "pass"], nproc_per_node=1, out=out, replace=replace)
        if not res.ok:
            rep = res.report or {}
            why = ((rep.get("root_cause") or {}).get("message")) or rep.get("reason") or res.state
            raise TrainletError(500, "setup failed: %s" % why)
        return res

    def attach(self, actor_id, pickle=False):
        """A handle on an actor deployed earlier (by id), without creating anything."""
        return Actor(self, actor_id, pickle=pickle)


from . import actor as _actor  # noqa: E402  (actor.py imports names from here lazily)
from .actor import (Actor, ActorError, ActorGone, ActorRestarted, Call, CallCancelled, CallTimeout,  # noqa: E402
                    CallFuture, Function, Method, WorkerDied)
from .cluster import UpError, Warm, connect, down, ls, up  # noqa: E402  (the kubernetes client is imported when used)
