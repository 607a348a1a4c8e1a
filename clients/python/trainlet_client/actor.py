"""Actors: a class instantiated once on every worker of every warm pod,
whose methods the driver calls (``POST /v1/actors``, ``.../calls``).

    a = t.actor("trainer:Trainer", files="./src", init_kwargs={"width": 32})
    a.setup(lr=0.1)          # every rank's result, in rank order
    a.train.rank0(steps=10)  # rank 0's result only (every rank still runs it)
    a.close()

Every public attribute name of an :class:`Actor` that is not one of its own
(``id``, ``target``, ``close``, ``record``, ``logs``, ``wait_ready``,
``method``) is a :class:`Method` of the remote object; ``a.method(name)``
reaches any name, reserved or not.
"""

import base64
import concurrent.futures
import json
import pickle as _pickle
import threading
import time
import urllib.parse

from . import ship as _ship

__all__ = ["Actor", "Function", "Method", "Call", "CallFuture",
           "ActorError", "WorkerDied", "ActorRestarted", "ActorGone", "CallCancelled"]

FINAL = ("succeeded", "failed", "stopped")
POLL = 30  # seconds one request waits for a call to end (the server allows up to 300)

# trainlet's own error types; any other type is the method's own Python exception.
TRAINLET_TYPES = ("WorkerDied", "ActorRestarted", "ActorGone", "CallCancelled", "BadResult")


class ActorError(Exception):
    """A call ended with at least one rank not ok.

    ``call`` (its number), ``failures`` (``[(rank, error dict)]``), ``results``
    (every rank's outcome in rank order: ``{"rank", "ok", "value"}`` or
    ``{"rank", "ok", "error"}``), and the root failure's ``type`` (e.g.
    ``"ValueError"``, ``"WorkerDied"``), ``rank``, ``error`` and
    ``remote_traceback``. The root is a ``WorkerDied`` if any, else a Python
    exception the method raised, else the first failure.
    """

    def __init__(self, message, call=None, failures=(), results=(), root=None, record=None):
        super().__init__(message)
        self.call = call
        self.failures = list(failures)
        self.results = list(results)
        self.record = record
        rank, err = root if root is not None else (None, {})
        self.rank = rank
        self.error = err
        self.type = err.get("type")
        self.remote_traceback = err.get("traceback")

    def __str__(self):
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\nremote traceback (rank %s):\n%s" % (self.rank, self.remote_traceback.rstrip())
        return text


class WorkerDied(ActorError):
    """The rank's worker process died during the call (``error["exit_code"]`` or ``error["signal"]``)."""


class ActorRestarted(ActorError):
    """The round ended before this rank finished (another rank died, a pod was lost); the actor is rebuilt."""


class ActorGone(ActorError):
    """The actor is closed, replaced, or failed for good (its restart budget is spent)."""


class CallCancelled(ActorError):
    """The call was cancelled (``Call.cancel()``)."""


_SUBCLASS = {"WorkerDied": WorkerDied, "ActorRestarted": ActorRestarted,
             "ActorGone": ActorGone, "CallCancelled": CallCancelled}


def _describe(rank, err):
    text = "rank %s: %s" % (rank, err.get("type") or "error")
    if err.get("type") == "WorkerDied":
        if err.get("signal"):
            text += " (signal %s)" % err["signal"]
        elif err.get("exit_code") is not None:
            text += " (exit code %s)" % err["exit_code"]
    if err.get("message"):
        text += ": %s" % err["message"]
    return text


def _root(failures):
    for rank, err in failures:
        if err.get("type") == "WorkerDied":
            return rank, err
    for rank, err in failures:
        if err.get("ran") and err.get("type") not in TRAINLET_TYPES:
            return rank, err
    return failures[0]


def error_for(call, method, results):
    """The :class:`ActorError` (subclass by the root's type) for a call's per-rank results."""
    failures = [(r["rank"], r.get("error") or {}) for r in results if not r.get("ok")]
    if not failures:
        return ActorError("call %s (%s) failed on no rank in particular" % (call, method), call, [], results)
    root = _root(failures)
    msg = "call %s (%s) failed: %s" % (call, method, _describe(*root))
    others = {}
    for rank, err in failures:
        if rank != root[0]:
            others.setdefault(err.get("type") or "error", []).append(str(rank))
    if others:
        msg += "; also " + ", ".join("%s on rank%s %s" % (t, "s" if len(rs) > 1 else "", ", ".join(rs))
                                     for t, rs in others.items())
    cls = _SUBCLASS.get(root[1].get("type"), ActorError)
    return cls(msg, call, failures, results, root)


def _b64pickle(obj):
    return base64.b64encode(_pickle.dumps(obj)).decode()


def _encode(args, kwargs, use_pickle):
    """The ``args``/``kwargs`` or ``pickle`` fields of a body."""
    if use_pickle:
        return {"pickle": _b64pickle((tuple(args), dict(kwargs)))}
    body = {"args": list(args), "kwargs": dict(kwargs)}
    try:
        json.dumps(body)
    except (TypeError, ValueError) as e:
        raise TypeError("arguments are not JSON (%s); pass pickle=True to send them pickled" % e) from None
    return body


def _decode(results):
    """Each rank's outcome in rank order, pickled values unpickled into ``value``."""
    out = []
    for r in sorted(results, key=lambda r: r["rank"]):
        r = dict(r)
        if r.get("ok") and "pickle" in r:
            r["value"] = _ship.loads(base64.b64decode(r.pop("pickle")))
        out.append(r)
    return out


class CallTimeout(TimeoutError):
    """A call still running when ``wait``/``result`` gave up. ``where`` maps each rank running
    the method to the place it is at (``file:line in function``, read from outside the worker
    by its pod's agent); ``stacks`` is the job's whole view (``Trainlet.stacks()``), or None
    when it could not be had."""

    def __init__(self, message, stacks=None, where=None):
        super().__init__(message)
        self.stacks = stacks
        self.where = where or {}


def _where(view, method):
    """Each rank's place (its innermost frame) in the thread running ``method``; when no rank
    of the view runs it, each rank's main thread's place."""
    ranks = list(view.get("ranks", []))
    for lane in view.get("lanes", []):
        ranks.extend(lane.get("ranks", []))

    def place(t):
        f = t["python"][0]
        return "%s:%s in %s" % (f["file"].rsplit("/", 1)[-1], f.get("line"), f["function"])

    out = {}
    for r in ranks:
        for t in r.get("stacks", {}).get("threads", []):
            names = [f.get("function", "").split(".")[-1] for f in t.get("python", [])]
            if method in names:
                out[r["rank"]] = place(t)
                break
    if not out:
        for r in ranks:
            threads = [t for t in r.get("stacks", {}).get("threads", []) if t.get("python")]
            if threads:
                out.setdefault(r["rank"], place(threads[0]))
    return out


class Call:
    """One call in flight: ``id``, ``done()``, ``result(timeout)``, ``wait(timeout)``, ``cancel()``."""

    def __init__(self, actor, method, doc):
        self.actor = actor
        self.method = method
        self.id = doc["call"]
        self._doc = doc if doc.get("done") else None

    def _path(self):
        return "%s/calls/%s" % (self.actor._path, self.id)

    def _poll(self, wait):
        doc = self.actor._t._request("GET", "%s?wait=%d" % (self._path(), wait), timeout=wait + 30)
        if doc.get("done"):
            self._doc = doc
        return doc

    def done(self):
        """Whether the call has ended (asks the API once, without waiting)."""
        if self._doc is None:
            self._poll(0)
        return self._doc is not None

    def wait(self, timeout=None):
        """The ended call's answer, ``{"call", "done", "ok", "results"}`` with the results
        decoded (never raises for a rank's failure); :class:`CallTimeout` (a TimeoutError that
        says where each rank is) if still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._doc is None:
            wait = POLL
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(timeout)
                wait = max(0, min(POLL, int(left)))
            self._poll(wait)
        doc = dict(self._doc)
        doc["results"] = _decode(doc.get("results", []))
        return doc

    def _timed_out(self, timeout):
        """The CallTimeout for a call still running after ``timeout``, saying where its ranks are."""
        message = "call %s (%s) still running after %ss" % (self.id, self.method, timeout)
        try:
            stacks = self.actor._t.stacks()
        except Exception as e:  # the stacks help explain; they never replace the timeout
            return CallTimeout("%s; no stacks (%s)" % (message, e))
        where = _where(stacks, self.method)
        if where:
            shown = sorted(where.items())[:4]
            message += "; " + "; ".join("rank %s at %s" % rw for rw in shown)
            if len(where) > 4:
                message += "; %d more ranks" % (len(where) - 4)
        else:
            message += "; no rank is in the method (GET /v1/stacks)"
        return CallTimeout(message, stacks, where)

    def result(self, timeout=None):
        """Every called rank's value in rank order; :class:`ActorError` if any rank failed."""
        return [v for _, v in self._values(timeout)]

    def _values(self, timeout=None):
        doc = self.wait(timeout)
        results = doc["results"]
        if not doc.get("ok") or not all(r.get("ok") for r in results):
            raise error_for(self.id, self.method, results)
        return [(r["rank"], r.get("value")) for r in results]

    def cancel(self):
        """Ask the workers to stop the call (``trainlet_actor.Cancelled`` in the method's thread);
        its ranks then end with ``CallCancelled``. Returns the API's state (``"cancelling"``)."""
        return self.actor._t._request("DELETE", self._path()).get("state")

    def __repr__(self):
        return "Call(actor=%r, id=%r, method=%r, done=%r)" % (self.actor.id, self.id, self.method,
                                                              self._doc is not None)


class CallFuture(concurrent.futures.Future):
    """The Future of ``method.submit(...)``; ``call`` is the :class:`Call` once posted,
    ``cancel_remote()`` cancels the call on the workers too."""

    def __init__(self):
        super().__init__()
        self.call = None
        self._cancel = False
        self._lock = threading.Lock()

    def cancel_remote(self):
        if self.cancel():  # not posted yet: it never will be
            return True
        with self._lock:
            self._cancel = True
            call = self.call
        if call is not None and not self.done():
            call.cancel()
        return False


class Method:
    """A method of the remote object. ``m(*a, **kw)`` calls it on every rank (or ``ranks=[...]``)
    and returns the values in rank order; ``m.rank0(...)`` returns rank 0's value;
    ``m.start(...)`` a :class:`Call`; ``m.submit(...)`` a :class:`CallFuture`;
    ``m.options(pickle=..., ranks=...)`` a copy with those defaults."""

    def __init__(self, actor, name, pickle=None, ranks=None):
        self.actor = actor
        self.name = name
        self._pickle = pickle
        self._ranks = ranks

    def options(self, pickle=None, ranks=None):
        return Method(self.actor, self.name,
                      self._pickle if pickle is None else pickle,
                      self._ranks if ranks is None else ranks)

    def _start(self, args, kwargs, ranks, wait):
        use_pickle = self.actor.pickle if self._pickle is None else self._pickle
        body = {"method": self.name}
        body.update(_encode(args, kwargs, use_pickle))
        ranks = self._ranks if ranks is None else ranks
        if ranks is not None:
            body["ranks"] = [int(r) for r in ranks]
        doc = self.actor._t._request("POST", "%s/calls?wait=%d" % (self.actor._path, wait), body,
                                     timeout=wait + 30)
        return Call(self.actor, self.name, doc)

    def start(self, *args, ranks=None, **kwargs):
        """Post the call and return at once with its :class:`Call`."""
        return self._start(args, kwargs, ranks, 0)

    def __call__(self, *args, ranks=None, **kwargs):
        return self._start(args, kwargs, ranks, POLL).result()

    def rank0(self, *args, ranks=None, **kwargs):
        """Call it (on every rank, unless ``ranks``) and return rank 0's value alone."""
        values = dict(self._start(args, kwargs, ranks, POLL)._values())
        if 0 not in values:
            raise ValueError("rank0() of a call that did not run on rank 0")
        return values[0]

    def submit(self, *args, ranks=None, **kwargs):
        """Run the call in the client's thread pool; returns a :class:`CallFuture` whose
        result is the list :meth:`__call__` returns."""
        fut = CallFuture()

        def work():
            if not fut.set_running_or_notify_cancel():
                return
            try:
                call = self._start(args, kwargs, ranks, POLL)
                with fut._lock:
                    fut.call = call
                    cancel = fut._cancel
                if cancel:
                    call.cancel()
                fut.set_result(call.result())
            except BaseException as e:
                fut.set_exception(e)

        self.actor._executor().submit(work)
        return fut

    def __repr__(self):
        return "Method(actor=%r, name=%r)" % (self.actor.id, self.name)


class Actor:
    """A deployed actor (see :meth:`trainlet_client.Trainlet.actor`). Reserved names:
    ``id``, ``target``, ``pickle``, ``close()``, ``record()``, ``logs(follow)``,
    ``wait_ready(timeout)``, ``method(name)``; every other public name is a remote method."""

    def __init__(self, client, actor_id, target=None, pickle=False):
        self._t = client
        self.id = actor_id
        self.target = target
        self.pickle = bool(pickle)
        self._path = "/v1/actors/" + urllib.parse.quote(actor_id)
        self._pool = None
        self._pool_lock = threading.Lock()
        self._follower = None
        self._closed = False

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return Method(self, name)

    def method(self, name):
        """The remote method ``name``, whichever name it is (``a.method("close")()``)."""
        return Method(self, name)

    def record(self):
        """The actor's record (``GET /v1/actors/{id}``): ``state``, ``ranks``, ``report``, ..."""
        return self._t._request("GET", self._path)

    def logs(self, follow=False):
        """Yield every rank's prefixed lines; with ``follow``, until the actor is over."""
        return self._t._lines(self._path + "/logs", follow)

    def wait_ready(self, timeout=300.0, poll=0.2):
        """Wait until the actor is ``running`` (its workers started; they may still be
        instantiating it, and a call waits for them); :class:`ActorGone` if it ended first
        (its failure report in the message), TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            rec = self.record()
            state = rec.get("state")
            if state == "running":
                return rec
            if state in FINAL:
                raise ActorGone("actor %s is %s before it was ready%s" % (self.id, state, _report(rec)),
                                record=rec)
            if time.monotonic() > deadline:
                raise TimeoutError("actor %s still %s after %ss" % (self.id, state, timeout))
            time.sleep(poll)

    def _follow(self, out):
        def copy():
            try:
                for line in self.logs(follow=True):
                    out.write(line + "\n")
                    out.flush()
            except Exception as e:  # the stream broke: say so once, the actor goes on
                if not self._closed:
                    out.write("trainlet-client: logs of %s: %s\n" % (self.id, e))
        self._follower = threading.Thread(target=copy, name="trainlet-logs-" + self.id, daemon=True)
        self._follower.start()

    def _executor(self):
        with self._pool_lock:
            if self._closed:
                raise RuntimeError("actor %s is closed" % self.id)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(32, "trainlet-call")
            return self._pool

    def close(self):
        """Close the actor (``DELETE /v1/actors/{id}``); calls in flight end with ``ActorGone``.
        Closing twice, or an actor already over, does nothing."""
        from . import TrainletError
        if self._closed:
            return
        self._closed = True
        try:
            self._t._request("DELETE", self._path)
        except TrainletError as e:
            if e.status not in (404, 409):
                raise
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
        if self._follower is not None:
            self._follower.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "Actor(id=%r, target=%r)" % (self.id, self.target)


class Function(Actor):
    """A one-method actor: a plain function deployed with :meth:`Trainlet.function`.
    ``f(...)``, ``f.rank0(...)``, ``f.start(...)``, ``f.submit(...)`` and ``f.options(...)``
    call its ``__call__``."""

    def __call__(self, *args, ranks=None, **kwargs):
        return self.method("__call__")(*args, ranks=ranks, **kwargs)

    def rank0(self, *args, ranks=None, **kwargs):
        return self.method("__call__").rank0(*args, ranks=ranks, **kwargs)

    def start(self, *args, ranks=None, **kwargs):
        return self.method("__call__").start(*args, ranks=ranks, **kwargs)

    def submit(self, *args, ranks=None, **kwargs):
        return self.method("__call__").submit(*args, ranks=ranks, **kwargs)

    def options(self, pickle=None, ranks=None):
        return self.method("__call__").options(pickle=pickle, ranks=ranks)


def _report(rec):
    """The failure report of a record, in a few words (empty without one)."""
    rep = rec.get("report")
    if not rep:
        return ""
    if isinstance(rep, dict):
        root = rep.get("root_cause") or {}
        text = "; ".join(str(p) for p in (rep.get("reason"), root.get("message")) if p)
        if root.get("traceback"):
            text += "\n" + root["traceback"].rstrip()
        if text:
            return ": " + text
    return ": " + json.dumps(rep)[:2000]


def create(client, cls, target, files=None, init_args=(), init_kwargs=None, nproc_per_node=None, env=None,
           max_restarts=None, replace=True, pickle=False, wait_ready=True, logs=None, ready_timeout=300.0,
           restart="all"):
    """``POST /v1/actors`` and the handle (see :meth:`trainlet_client.Trainlet.actor`)."""
    from . import _collect
    if restart not in ("all", "survivors"):
        raise ValueError("restart=%r: 'all' (every rank restarts) or 'survivors' (only the missing ones)"
                         % (restart,))
    files = _collect(files)
    if not isinstance(target, str):
        # A class or function object: by name when importable, else its
        # source and what it needs from __main__, as a module of its own.
        target, extra = _ship.shipped(target)
        clash = sorted(set(extra) & set(files))
        if clash:
            raise ValueError("files already hold %s, the module built for %s" % (clash[0], target))
        files.update(extra)
    spec = {"target": target}
    if restart != "all":
        spec["restart"] = restart
    spec.update(_encode(init_args, init_kwargs or {}, pickle))
    body = {
        "files": {k: base64.b64encode(v).decode() for k, v in files.items()},
        "env": dict(env or {}),
        "replace": bool(replace),
        "actor": spec,
    }
    if nproc_per_node is not None:
        body["nproc_per_node"] = int(nproc_per_node)
    if max_restarts is not None:
        body["max_restarts"] = int(max_restarts)
    doc = client._request("POST", "/v1/actors", body)
    a = cls(client, doc["id"], target, pickle)
    if logs is not None:
        a._follow(logs)
    if wait_ready:
        try:
            a.wait_ready(ready_timeout)
        except BaseException:
            try:
                a.close()
            except Exception:
                pass
            raise
    return a
