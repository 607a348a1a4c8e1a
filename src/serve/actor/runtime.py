"""trainlet's actor runtime: the worker side of an actor.

The agent starts every worker of an actor as ``python actor_runtime.py``
(or runs this file with ``runpy.run_path(path, run_name="__main__")`` in a
forked zygote), in the run's directory, with the environment a torchrun
worker gets plus ``TRAINLET_ACTOR_SOCKET``: the Unix stream socket where the
agent listens. The worker connects, imports and instantiates the target
once, then runs every call the agent sends in a thread of its own, so calls
are concurrent (``state()`` answers while ``train()`` runs).

Protocol. Every frame is a 4-byte big-endian length, then a UTF-8 JSON
object of that many bytes (at most 64 MiB; a larger incoming frame ends the
worker, a larger result is answered as a ``BadResult`` fault)::

    worker  {"op": "hello", "rank": R, "local_rank": L, "pid": P}   first frame
    agent   {"op": "init", "target": "pkg.mod:Name", "encoding": E, "args": A}
    worker  {"op": "ready"}                       instantiated; calls may come
    worker  {"op": "init_failed", "error": F}     then the worker exits 1
    agent   {"op": "call", "id": N, "method": "m", "encoding": E, "args": A}
    agent   {"op": "cancel", "id": N}             raise Cancelled in call N
    worker  {"op": "result", "id": N, "ok": true, "value": V}
    worker  {"op": "result", "id": N, "ok": false, "error": F}
    agent   {"op": "reconfigure", "env": {"RANK": "2", ...}}   survivors mode

- ``E`` is ``"json"`` or ``"pickle"``. ``A`` is the JSON text of
  ``{"args": [...], "kwargs": {...}}``, or base64 of the pickled
  ``(args, kwargs)``. ``V`` is the JSON text of the result (objects with
  ``.tolist()`` or ``.item()``, such as tensors and arrays, become lists or
  numbers), or base64 of its pickle.
- ``F`` (a fault) is ``{"type", "module", "message", "traceback"}`` of the
  exception raised, or of trainlet's own: ``CallCancelled``, ``BadResult``.
- ``Name`` may be dotted (``Outer.Inner``). A class is instantiated with the
  init arguments; any other callable is a function actor, whose only method
  is ``__call__``. Methods whose names start with ``_`` cannot be called.
- The agent closing the connection ends the worker (exit 0).

Survivors mode (``restart="survivors"``). When a worker dies or a pod is
lost, joins or leaves, the live workers are kept and each gets
``reconfigure`` with the new round's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...). In a thread of its
own, the worker then: cancels the calls still running (their round is
over; it waits up to ``RECONFIGURE_DRAIN`` seconds for their threads to
end: one blocked in C code, a sleep or a collective with a live peer, goes
on in the background and its late result is dropped); destroys torch's default process group if there is one; puts the
variables in ``os.environ``; creates the default group again with the same
backend, meeting the fresh ranks' ``__init__``; and calls the instance's
``reconfigure(rank, world_size)`` if it has one (where DDP is wrapped
again: its constructor broadcasts rank 0's parameters, which the fresh
ranks' constructors take). Then it says ``ready``; if any of this raises,
``init_failed`` and exit 1, as a failed ``__init__``. A collective blocked
on a peer that is alive but was stopped (NCCL without async error
handling) never returns: survivors mode needs gloo, or NCCL with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (trainlet's default in survivors mode:
the communicator is aborted, the process kept).

Cancellation. ``cancel`` raises ``trainlet_actor.Cancelled`` (a
``BaseException``, so ``except Exception`` does not swallow it) in the call's
thread with ``PyThreadState_SetAsyncExc``. It takes effect at the thread's
next Python bytecode: a thread inside C code is interrupted only when that
code returns to Python. Measured on CPython 3.11: ``time.sleep(3)``,
``Event.wait(3)``, ``Lock.acquire(timeout=3)`` and ``subprocess.run`` are
NOT interrupted (they end after their 3 s, then the call is cancelled); a
loop of short sleeps, or of torch operations, is cancelled within one
iteration; a blocked collective (NCCL, gloo) is interrupted only when it
returns, if ever. A method that should be cancellable works in short steps.
If a cancelled call raises anything (``Cancelled`` or what user code turned
it into), its fault is ``CallCancelled``; if it catches ``Cancelled`` and
returns, its value is the result.

User code may ``import trainlet_actor`` for ``Cancelled`` and
``current_call()`` (the id of the call the calling thread runs, or None).
Standard library only; Python 3.9+.
"""

import posix  # built in, like sys: found nowhere on sys.path
import sys


def _forget_own_dir():
    """Drop this file's directory (the pod's serve directory, which runs
    can write) from sys.path before anything else is imported: a module
    an earlier run left there (json.py) is never imported in its place."""
    here = globals().get("__file__", "").rpartition("/")[0] or "."
    try:
        mine = posix.stat(here)
    except OSError:
        return
    kept = []
    for p in sys.path:
        try:
            st = posix.stat(p or ".")
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                continue
        except OSError:
            pass
        kept.append(p)
    sys.path[:] = kept


_forget_own_dir()

import base64  # noqa: E402
import ctypes  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

MAX_FRAME = 64 * 1024 * 1024
RECONFIGURE_DRAIN = 1.0
THIS_FILE = os.path.abspath(__file__) if "__file__" in globals() else None


class Cancelled(BaseException):
    """Raised in a call's thread when the driver cancels the call."""


Cancelled.__module__ = "trainlet_actor"
_local = threading.local()


def current_call():
    """The id of the call this thread runs, or None outside a call."""
    return getattr(_local, "call", None)


# The module user code imports: the same objects, whether this file runs as
# a script or through runpy (where its own module is a temporary one).
api = types.ModuleType("trainlet_actor", "trainlet's actor runtime, as user code sees it.")
api.Cancelled = Cancelled
api.current_call = current_call
api.MAX_FRAME = MAX_FRAME


def exit_now(code):
    """Flush what the user printed and leave at once: daemon call threads
    and threads the user started must not keep the worker alive."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def write_error_file(exc):
    """Write ``exc`` to the worker's TORCHELASTIC_ERROR_FILE, as torch's
    ``@record`` does, so that the failure report names it (its message and
    traceback) rather than an exit code alone."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    doc = {"message": {"message": "%s: %s" % (type(exc).__name__, exc),
                       "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(doc, f)
    except OSError:
        pass


class Conn:
    """The agent's socket: the main thread reads, any thread writes whole
    frames under one lock."""

    def __init__(self, sock):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, frame):
        body = json.dumps(frame).encode()
        if len(body) > MAX_FRAME:
            raise ValueError("frame of %d bytes, more than %d" % (len(body), MAX_FRAME))
        try:
            with self.lock:
                self.sock.sendall(struct.pack(">I", len(body)) + body)
        except OSError:
            exit_now(0)  # the agent is gone: nothing to answer to

    def read_exact(self, n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], min(n - got, 1 << 20))
            if k == 0:
                return None
            got += k
        return bytes(buf)

    def recv(self):
        """The next frame; None when the agent closed the connection."""
        head = self.read_exact(4)
        if head is None:
            return None
        (n,) = struct.unpack(">I", head)
        if n > MAX_FRAME:
            print("trainlet actor: the agent sent a frame of %d bytes (at most %d); leaving" % (n, MAX_FRAME),
                  file=sys.stderr)
            exit_now(1)
        body = self.read_exact(n)
        if body is None:
            return None
        frame = json.loads(body)
        if not isinstance(frame, dict):
            raise ValueError("a frame is a JSON object, not %s" % type(frame).__name__)
        return frame


def fault(exc, kind=None, module=None, message=None):
    """A fault frame's ``error`` for ``exc``, its traceback without this
    file's frames (the user's code is what matters) unless all are ours."""
    tb = exc.__traceback__
    while tb is not None and THIS_FILE and os.path.abspath(tb.tb_frame.f_code.co_filename) == THIS_FILE:
        tb = tb.tb_next
    tb = tb or exc.__traceback__
    try:
        text = str(exc)
    except Exception:
        text = "<%s whose str() raised>" % type(exc).__name__
    return {
        "type": kind or type(exc).__name__,
        "module": module or type(exc).__module__,
        "message": text if message is None else message,
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
    }


# The module that stands for the driver's __main__: a class or function the
# client shipped by value (trainlet_client.ship) is a module of its own whose
# name starts with SHIPPED; pickled arguments that name the driver's
# __main__ classes find them there.
SHIPPED = "_trainlet_main_"
_driver_main = None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "__main__" and _driver_main is not None:
            obj = _driver_main
            for part in name.split("."):
                if not hasattr(obj, part):
                    raise AttributeError(
                        "%s of the driver's __main__ did not travel with the actor: name it in the actor's "
                        "code, or define it in a module sent with files=" % name)
                obj = getattr(obj, part)
            return obj
        return super().find_class(module, name)


def decode_args(encoding, text):
    if encoding == "json":
        a = json.loads(text) if text else {}
        return list(a.get("args") or []), dict(a.get("kwargs") or {})
    if encoding == "pickle":
        args, kwargs = _Unpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
        return list(args), dict(kwargs or {})
    raise ValueError("unknown encoding %r (json or pickle)" % (encoding,))


def to_json(obj):
    """``json.dumps``'s default: tensors and arrays become lists, numpy and
    torch scalars become numbers."""
    for name in ("tolist", "item"):
        f = getattr(obj, name, None)
        if callable(f):
            return f()
    raise TypeError("%s is not JSON-serializable" % type(obj).__name__)


def encode_value(encoding, value, method):
    if encoding == "pickle":
        return base64.b64encode(pickle.dumps(value)).decode()
    try:
        return json.dumps(value, default=to_json)
    except (TypeError, ValueError) as e:
        raise BadResult("the return value of %s is not JSON-serializable (%s): return JSON values "
                        "(lists, dicts, numbers, strings), or call it with pickle" % (method, e)) from e


class BadResult(Exception):
    """A result that cannot be sent (not encodable, too large)."""


BadResult.__module__ = "trainlet_actor"


class Call:
    """One call: ``running`` and ``cancelled`` change under ``lock`` only,
    so that a cancel is raised at most once, and only while the call's own
    code runs."""

    def __init__(self, frame):
        self.id = frame.get("id")
        self.method = frame.get("method")
        self.encoding = frame.get("encoding", "json")
        self.args = frame.get("args", "")
        self.lock = threading.Lock()
        self.running = False
        self.cancelled = False
        self.ident = None

    def cancel(self):
        with self.lock:
            if self.cancelled:
                return
            self.cancelled = True
            if self.running:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(Cancelled))

    def start(self):
        with self.lock:
            if self.cancelled:
                raise Cancelled()
            self.ident = threading.get_ident()
            self.running = True

    def finish(self):
        """No cancel from now on. A cancel raised but not yet delivered is
        withdrawn here, or delivered here (raised out of this method): it
        can never land later in the code that sends the result."""
        with self.lock:
            self.running = False
            if self.cancelled and self.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)


class Actor:
    def __init__(self, conn):
        self.conn = conn
        self.instance = None
        self.function = False  # a function actor: only __call__
        self.calls = {}  # id -> Call, while it runs
        self.calls_lock = threading.Lock()

    def init(self, frame):
        """Import and instantiate; on failure, say so and exit 1."""
        try:
            module_name, _, attr = frame["target"].partition(":")
            if not module_name or not attr:
                raise ValueError("target %r is not 'package.module:Name'" % frame["target"])
            obj = importlib.import_module(module_name)
            if module_name.startswith(SHIPPED):
                global _driver_main
                _driver_main = obj
            for part in attr.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, type):
                args, kwargs = decode_args(frame.get("encoding", "json"), frame.get("args", ""))
                self.instance = obj(*args, **kwargs)
            elif callable(obj):
                self.instance, self.function = obj, True
            else:
                raise TypeError("target %s is a %s, not a class or a function" % (frame["target"], type(obj).__name__))
        except BaseException as e:  # SystemExit in an import is a failure too
            traceback.print_exc()
            print("trainlet actor: cannot instantiate %s" % frame.get("target"), file=sys.stderr)
            write_error_file(e)
            self.conn.send({"op": "init_failed", "error": fault(e)})
            exit_now(1)
        self.conn.send({"op": "ready"})

    def method(self, name):
        """The bound method ``name``, or the exception that refuses it."""
        if not isinstance(name, str):
            raise TypeError("a method's name is a string, not %r" % (name,))
        if self.instance is None:
            raise RuntimeError("the actor is not initialized: no init before call %s" % name)
        if self.function:
            if name == "__call__":
                return self.instance
            if name.startswith("_"):
                raise AttributeError("%s is private; only public methods can be called" % name)
            raise AttributeError("function actor %s has no method %r: call it with __call__"
                                 % (getattr(self.instance, "__name__", "?"), name))
        if name.startswith("_"):
            raise AttributeError("%s is private; only public methods can be called" % name)
        cls = type(self.instance).__name__
        try:
            attr = getattr(self.instance, name)
        except AttributeError as e:
            raise AttributeError("%s has no method %r" % (cls, name)) from e
        if not callable(attr):
            raise TypeError("%s.%s is a %s, not a method" % (cls, name, type(attr).__name__))
        return attr

    def call(self, frame):
        call = Call(frame)
        with self.calls_lock:
            self.calls[call.id] = call
        try:
            threading.Thread(target=self.run, args=(call,), name="trainlet-call-%s" % call.id, daemon=True).start()
        except RuntimeError as e:  # can't start new thread
            with self.calls_lock:
                self.calls.pop(call.id, None)
            self.conn.send({"op": "result", "id": call.id, "ok": False, "error": fault(e)})

    def cancel(self, frame):
        with self.calls_lock:
            call = self.calls.get(frame.get("id"))
        if call is not None:
            call.cancel()

    def run(self, call):
        """A call's thread: run the method, answer its result or fault."""
        _local.call = call.id
        try:
            try:
                call.start()
                fn = self.method(call.method)
                args, kwargs = decode_args(call.encoding, call.args)
                value = fn(*args, **kwargs)
            finally:
                call.finish()
            answer = {"op": "result", "id": call.id, "ok": True,
                      "value": encode_value(call.encoding, value, call.method)}
        except BaseException as e:
            if call.cancelled:
                error = fault(e, "CallCancelled", "trainlet_actor", "call %s (%s) was cancelled" % (call.id, call.method))
            elif isinstance(e, BadResult):
                error = fault(e, "BadResult")
            else:
                error = fault(e)
            answer = {"op": "result", "id": call.id, "ok": False, "error": error}
        finally:
            _local.call = None
            with self.calls_lock:
                self.calls.pop(call.id, None)
        try:
            self.conn.send(answer)
        except ValueError as e:  # larger than a frame
            message = "the result of %s does not fit in a frame: %s" % (call.method, e)
            self.conn.send({"op": "result", "id": call.id, "ok": False,
                            "error": fault(e, "BadResult", "trainlet_actor", message)})

    def reconfigure(self, frame):
        threading.Thread(target=self.rejoin, args=(frame,), name="trainlet-reconfigure", daemon=True).start()

    def rejoin(self, frame):
        """Survivors mode: join the new round (see the module doc)."""
        try:
            env = frame.get("env")
            if not isinstance(env, dict):
                raise ValueError("reconfigure without its variables")
            with self.calls_lock:
                running = list(self.calls.values())
            for call in running:
                call.cancel()
            deadline = time.monotonic() + RECONFIGURE_DRAIN
            while time.monotonic() < deadline:
                with self.calls_lock:
                    if not self.calls:
                        break
                time.sleep(0.01)
            dist = sys.modules.get("torch.distributed")
            backend = None
            if dist is not None and dist.is_available() and dist.is_initialized():
                backend = dist.get_backend()
                dist.destroy_process_group()
            os.environ.update({str(k): str(v) for k, v in env.items()})
            if backend is not None:
                dist.init_process_group(backend)
            hook = None if self.function else getattr(self.instance, "reconfigure", None)
            if callable(hook):
                hook(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
            elif backend is not None:
                print("trainlet actor: %s has no reconfigure(rank, world_size): a model wrapped in DDP must "
                      "be wrapped again there, or the fresh ranks' DDP waits for this rank's broadcast"
                      % type(self.instance).__name__, file=sys.stderr)
        except BaseException as e:
            traceback.print_exc()
            print("trainlet actor: cannot rejoin the new round", file=sys.stderr)
            self.conn.send({"op": "init_failed", "error": fault(e)})
            exit_now(1)
        self.conn.send({"op": "ready"})

    def serve(self):
        while True:
            frame = self.conn.recv()
            if frame is None:
                exit_now(0)
            op = frame.get("op")
            if op == "call":
                self.call(frame)
            elif op == "cancel":
                self.cancel(frame)
            elif op == "init" and self.instance is None:
                self.init(frame)
            elif op == "reconfigure" and self.instance is not None:
                self.reconfigure(frame)
            else:
                print("trainlet actor: ignoring a frame %r" % (op,), file=sys.stderr)


def main():
    path = os.environ.get("TRAINLET_ACTOR_SOCKET")
    if not path:
        print("trainlet actor: TRAINLET_ACTOR_SOCKET is not set; this file is run by trainlet's agent",
              file=sys.stderr)
        exit_now(2)
    sys.modules["trainlet_actor"] = api
    for stream in (sys.stdout, sys.stderr):  # what calls print reaches the logs as it happens
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    cwd = os.getcwd()
    if cwd in sys.path:
        sys.path.remove(cwd)
    sys.path.insert(0, cwd)  # the user's files
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        print("trainlet actor: cannot connect to the agent at %s: %s" % (path, e), file=sys.stderr)
        exit_now(2)
    conn = Conn(sock)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    try:
        conn.send({"op": "hello", "rank": rank, "local_rank": local_rank, "pid": os.getpid()})
        Actor(conn).serve()
    except OSError:
        exit_now(0)  # the socket broke: the agent is gone
    except KeyboardInterrupt:
        exit_now(130)  # SIGINT, from the agent or a terminal: no traceback
    except ValueError as e:  # a frame that is not JSON
        print("trainlet actor: a bad frame from the agent: %s" % e, file=sys.stderr)
        exit_now(1)


if __name__ == "__main__":
    main()
