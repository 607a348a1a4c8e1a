"""N pods on this machine, one job through its life (issue 56): what each step costs as N grows.

N real trainlet processes (one per pod, each with its own loopback address
127.0.X.Y) are the pods of one static job of N nodes, two of them spares
(`--spares 2`); pod 0 serves the store. Each pod's one worker is `cat` on a
FIFO: it waits, using no CPU, until this script opens the FIFO for writing
and closes it, and then exits 0. The job goes through:

1. first round: from the launch of the first pod to the store host's "round
   formed" with both spares waiting;
2. idle: 5 s of a formed round (heartbeats, status), the store host's CPU and
   the bytes on the loopback interface per second;
3. SIGTERM: a training pod's agent and worker (its session) get SIGTERM, as a
   deleted pod; to the next "round formed" (a spare in its place);
4. SIGKILL: another training pod's session gets SIGKILL, as an agent the OOM
   killer took (no goodbye; the store host reads its closed connection);
5. restart: one pod's worker is killed (SIGKILL); every pod's workers
   restart: to the next "round formed";
6. end: the FIFO is opened and closed until every worker has read its end;
   to the last pod's exit, every live pod exiting 0.

For each step: its time, the CPU seconds of the store host and of the other
pods (agents and their workers, each group in a cgroup of its own, so this
needs root and a cgroup v2 mount) and the bytes on the loopback interface (every store message with
its TCP/IP headers, both ways; traffic of other programs on loopback counts
too, so run it on a quiet machine). At the end the store host's peak RSS.

Usage: python3 benches/scale.py --bin target/.../release/trainlet --pods 64 256 1024

All pods share this machine's CPUs: at hundreds of pods each step's time
includes every agent's own work, which a real cluster spreads over as many
machines; the other pods' CPU seconds each say what one costs.
"""

import argparse
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from lost_pod import free_port, pod_env, proc_stats


def lo_bytes() -> int:
    with open("/sys/class/net/lo/statistics/rx_bytes") as f:
        return int(f.read())


class Cgroup:
    """A cgroup v2 group of its own for CPU accounting: `usage_usec` counts
    every process in it, those that exited included, to the microsecond
    (/proc's per-process times are in 10 ms ticks and forget the dead)."""

    def __init__(self, name: str):
        with open("/proc/mounts") as f:
            roots = [l.split()[1] for l in f if l.split()[2] == "cgroup2"]
        if not roots:
            sys.exit("no cgroup v2 mount (/proc/mounts): this benchmark counts CPU through one")
        self.path = f"{roots[0]}/{name}"
        try:
            os.mkdir(self.path)
        except OSError as e:
            sys.exit(f"cannot make the cgroup {self.path} ({e}): run this benchmark as root")

    def enter(self) -> None:
        """Move the calling process in (a child before its exec)."""
        with open(f"{self.path}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def cpu_s(self) -> float:
        with open(f"{self.path}/cpu.stat") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("usage_usec")) / 1e6

    def remove(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def children(pid: int) -> list[int]:
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        pass
    return out


class Job:
    def __init__(self, args, n: int):
        self.args, self.n = args, n
        self.dir = tempfile.mkdtemp(prefix=f"scale-{n}-")
        self.fifo = f"{self.dir}/end"
        os.mkfifo(self.fifo)
        self.logs = [f"{self.dir}/{i}.err" for i in range(n)]
        self.pods: list[subprocess.Popen] = []
        self.gone: set[int] = set()
        self.host_cg = Cgroup(f"trainlet-scale-{os.getpid()}-host")
        self.pods_cg = Cgroup(f"trainlet-scale-{os.getpid()}-pods")

    def launch(self) -> None:
        port = free_port()
        for i in range(self.n):
            env = pod_env(i, port)
            with open(self.logs[i], "w") as err:
                self.pods.append(
                    subprocess.Popen(
                        [self.args.bin, "run", "--nnodes", str(self.n), "--spares", "2",
                         "--max-restarts", "3", "--no-python", "cat", self.fifo],
                        env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                        preexec_fn=(self.host_cg if i == 0 else self.pods_cg).enter,
                    )
                )

    def log(self, i: int) -> str:
        with open(self.logs[i]) as f:
            return f.read()

    def formed(self) -> int:
        return self.log(0).count("round formed")

    def spares(self) -> int:
        return sum(1 for i in range(1, self.n) if i not in self.gone and self.is_spare(i))

    def wait(self, what: str, done) -> None:
        started = time.time()
        while not done():
            if time.time() - started > self.args.timeout:
                sys.exit(f"{self.n} pods: no {what} in {self.args.timeout} s; logs in {self.dir}")
            time.sleep(0.005)

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the store host and of every other pod (agents and workers)."""
        return self.host_cg.cpu_s(), self.pods_cg.cpu_s()

    def is_spare(self, i: int) -> bool:
        """Pod i waits as a spare now: it said so after it last took a rank over."""
        text = self.log(i)
        return text.rfind("waiting as a spare") > text.rfind("this spare takes over")

    def training_pod(self) -> int:
        """A live pod that is not the store host and not waiting as a spare."""
        for i in range(self.n - 1, 0, -1):
            if i not in self.gone and not self.is_spare(i):
                return i
        sys.exit("no training pod to signal")

    def end(self) -> None:
        """Open and close the FIFO until every worker read its end."""
        while any(p.poll() is None for i, p in enumerate(self.pods) if i not in self.gone):
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            except OSError as e:
                if e.errno != errno.ENXIO:  # no reader at this moment
                    raise
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.pods:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.pods:
            p.wait()
        self.host_cg.remove()
        self.pods_cg.remove()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def step(job: Job, name: str, act, done) -> dict:
    cpu0, lo0, t0 = job.cpu(), lo_bytes(), time.time()
    act()
    job.wait(name, done)
    took = time.time() - t0
    cpu1, lo1 = job.cpu(), lo_bytes()
    return {"step": name, "s": took, "host_cpu_s": cpu1[0] - cpu0[0], "pods_cpu_s": cpu1[1] - cpu0[1], "lo_bytes": lo1 - lo0}


def run(args, n: int) -> dict:
    job = Job(args, n)
    try:
        steps = []
        steps.append(step(job, "first round", job.launch, lambda: job.formed() >= 1 and job.spares() >= 2))
        time.sleep(2.0)
        idle = step(job, "idle 5 s", lambda: time.sleep(5.0), lambda: True)
        steps.append(idle)
        for name, sig in (("SIGTERM of a pod", signal.SIGTERM), ("SIGKILL of a pod", signal.SIGKILL)):
            victim = job.training_pod()
            before = job.formed()
            def act(victim=victim, sig=sig):
                os.killpg(job.pods[victim].pid, sig)
                job.gone.add(victim)
            steps.append(step(job, name, act, lambda before=before: job.formed() > before))
            time.sleep(2.0)
        victim = job.training_pod()
        workers = children(job.pods[victim].pid)
        if not workers:
            sys.exit(f"pod {victim} has no worker to kill; logs in {job.dir}")
        before = job.formed()
        steps.append(step(job, "restart (a worker killed)", lambda: os.kill(workers[0], signal.SIGKILL), lambda: job.formed() > before))
        time.sleep(2.0)
        rss = proc_stats(job.pods[0].pid)[0]
        live = [i for i in range(n) if i not in job.gone]
        steps.append(step(job, "end (every worker exits 0)", job.end, lambda: all(job.pods[i].poll() is not None for i in live)))
        bad = {i: job.pods[i].returncode for i in live if job.pods[i].returncode != 0}
        if bad:
            sys.exit(f"{n} pods: pods exited non-zero: {dict(list(bad.items())[:8])}; logs in {job.dir}")
        return {"pods": n, "host_peak_rss_mb": rss, "idle_lo_bytes_per_s": idle["lo_bytes"] / idle["s"], "steps": steps}
    finally:
        job.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the trainlet binary (a release build)")
    ap.add_argument("--pods", type=int, nargs="+", default=[64, 256], help="pods in all, the two spares included (>= 4)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    ap.add_argument("--json", help="append each N's result to this file, a JSON object a line")
    ap.add_argument("--keep", action="store_true", help="keep the pods' logs (the directory is named on failure)")
    args = ap.parse_args()
    if min(args.pods) < 4:
        sys.exit("--pods: at least 4 (two training pods and two spares)")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for n in args.pods:
        r = run(args, n)
        print(f"{n} pods: store host peak RSS {r['host_peak_rss_mb']:.1f} MB; idle {r['idle_lo_bytes_per_s'] / 1e3:.1f} kB/s on loopback")
        for s in r["steps"]:
            print(
                f"  {s['step']:<28} {s['s']:7.3f} s   store host CPU {s['host_cpu_s']:6.3f} s   "
                f"other pods' CPU {s['pods_cpu_s']:7.3f} s ({s['pods_cpu_s'] / (n - 1) * 1e3:5.2f} ms each)   "
                f"loopback {s['lo_bytes'] / 1e6:7.2f} MB",
                flush=True,
            )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
