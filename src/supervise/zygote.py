# trainlet's Python zygote (src/supervise/zygote.rs runs it as `python -c`).
#
# Imports the modules named in argv once, then forks python workers on
# request so they start with those modules loaded. Each request comes over
# the agent's Unix socket ($TRAINLET_ZYGOTE_SOCKET) as a 4-byte length and
# JSON, with the worker's stdout and stderr as SCM_RIGHTS file descriptors.
# A worker is forked through an intermediate process that exits at once, so
# it is re-parented to the agent (a child subreaper or PID 1), which reaps
# and supervises it like a worker it exec'd. The worker then sets itself up
# as trainlet's exec'd workers are (process group, signal mask, death
# signal, stdio, cwd, environment, CPUs, memory node, OOM score) and runs
# its target the way `python [-u] [-B] script|-m module|-c code` would.
#
# The zygote never runs user code, never initialises CUDA and starts no
# thread of its own; it exits when the agent closes the socket.
import json
import os
import socket
import struct
import sys

MAX_REQUEST = 16 * 1024 * 1024
TORCH_COMPANIONS = ("torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo")


def send(sock, doc):
    data = json.dumps(doc).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def recv(sock):
    head, fds, _, _ = socket.recv_fds(sock, 4, 4)
    if len(head) == 0:
        return None, fds
    rest = recv_exact(sock, 4 - len(head)) if len(head) < 4 else b""
    if rest is None:
        return None, fds
    (n,) = struct.unpack("<I", head + rest)
    if n > MAX_REQUEST:
        return None, fds
    body = recv_exact(sock, n)
    if body is None:
        return None, fds
    return json.loads(body), fds


def threads():
    names = []
    for t in sorted(os.listdir("/proc/self/task")):
        try:
            with open("/proc/self/task/%s/comm" % t) as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def serve(sock, modules):
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except BaseException as e:  # noqa: BLE001 - reported to the agent
            send(sock, {"error": "import %s failed: %s: %s" % (m, type(e).__name__, e)})
            return None
    # What a training step imports lazily the first time it runs (DDP's
    # constructor imports torch._dynamo: over a second): preloaded too, so
    # `--preload torch` means torch ready to train. Best effort.
    if "torch" in modules:
        for m in TORCH_COMPANIONS:
            try:
                importlib.import_module(m)
            except Exception:  # noqa: BLE001 - an optional warm-up
                pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        send(sock, {"error": "CUDA was initialised while importing %s; a forked worker could not use it" % ",".join(modules)})
        return None
    send(sock, {"ready": True, "pid": os.getpid(), "threads": threads()})
    while True:
        req, fds = recv(sock)
        if req is None:
            os._exit(0)
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds + [r, w]:
                os.close(fd)
            send(sock, {"error": "fork failed: %s" % e, "errno": e.errno})
            continue
        if pid == 0:
            os.close(r)
            try:
                worker = os.fork()
            except OSError as e:
                os.write(w, ("E%d" % (e.errno or 0)).encode())
                os._exit(0)
            if worker == 0:
                os.close(w)
                return req, fds
            # Its own process group before the agent learns its pid, so a
            # group signal can never miss it.
            try:
                os.setpgid(worker, worker)
            except OSError:
                pass
            os.write(w, str(worker).encode())
            os._exit(0)
        os.close(w)
        answer = b""
        while True:
            part = os.read(r, 64)
            if not part:
                break
            answer += part
        os.close(r)
        os.waitpid(pid, 0)
        for fd in fds:
            os.close(fd)
        if answer.startswith(b"E") or not answer:
            errno = int(answer[1:] or b"0")
            send(sock, {"error": "fork failed: %s" % os.strerror(errno), "errno": errno})
        else:
            send(sock, {"pid": int(answer)})


def become_worker(sock, req, fds):
    import ctypes
    import io
    import signal
    import time

    agent = req["agent"]
    # Re-parented to the agent once the intermediate exited.
    deadline = time.monotonic() + 10
    while os.getppid() != agent:
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.0001)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: as exec'd workers
    if os.getppid() != agent:
        os._exit(70)
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    sock.close()
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    # Only stdio stays open, as across exec (everything else is CLOEXEC).
    os.closerange(3, 1 << 16)
    os.chdir(req["cwd"])
    env = req["env"]
    # A fresh interpreter coerces the C locale (PEP 538); so did the zygote.
    coerced = os.environ.get("LC_CTYPE")
    os.environ.clear()
    os.environ.update(env)
    if (
        coerced
        and "LC_ALL" not in env
        and env.get("PYTHONCOERCECLOCALE") != "0"
        and env.get("LC_CTYPE", env.get("LANG", "C")) in ("C", "POSIX", "")
    ):
        os.environ["LC_CTYPE"] = coerced
    if req.get("cpus"):
        try:
            os.sched_setaffinity(0, req["cpus"])
        except OSError:
            pass
    if req.get("mem_node") is not None:
        nr = {"x86_64": 238, "aarch64": 237}.get(os.uname().machine)
        if nr is not None:
            node = req["mem_node"]
            mask = (ctypes.c_ulong * (node // 64 + 1))()
            mask[node // 64] = 1 << (node % 64)
            libc.syscall(nr, 1, mask, ctypes.c_ulong(len(mask) * 64 + 1))  # MPOL_PREFERRED
    if req.get("oom_score_adj") is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(req["oom_score_adj"]))
        except OSError:
            pass
    # Standard streams as a fresh interpreter opens them on pipes.
    unbuffered = req.get("unbuffered") or bool(env.get("PYTHONUNBUFFERED"))
    enc = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    for fd, name, errors in ((0, "stdin", "strict"), (1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        mode = "rb" if fd == 0 else "wb"
        raw = io.FileIO(fd, mode, closefd=False)
        buf = raw if (unbuffered and fd) else (io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw))
        stream = io.TextIOWrapper(
            buf, encoding=enc, errors=errors, line_buffering=(fd == 2), write_through=bool(unbuffered and fd)
        )
        setattr(sys, name, stream)
        setattr(sys, "__%s__" % name, stream)
    sys.dont_write_bytecode = bool(req.get("dont_write_bytecode") or env.get("PYTHONDONTWRITEBYTECODE"))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in reversed(extra):
        if p not in sys.path:
            sys.path.insert(1, p)
    # Each process seeds its generators afresh, as a fresh interpreter does.
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    return req


def run(req):
    import runpy

    kind, target = req["kind"], req["target"]
    sys.argv = list(req["argv"])
    if kind == "script":
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target, alter_argv=True)
    else:
        sys.path[0] = ""
        code = compile(target, "<string>", "exec")
        main = sys.modules["__main__"]
        for k in [k for k in vars(main) if not k.startswith("__")]:
            delattr(main, k)
        exec(code, vars(main))


def main():
    path = os.environ.pop("TRAINLET_ZYGOTE_SOCKET")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    got = serve(sock, [m for m in sys.argv[1:] if m])
    if got is None:
        os._exit(1)
    req, fds = got
    return become_worker(sock, req, fds)


REQ = main()
del main, serve, become_worker, send, recv, recv_exact, threads, TORCH_COMPANIONS, MAX_REQUEST
run(REQ)
