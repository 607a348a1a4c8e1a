"""A lost pod at N pods (issue 56): real trainlet agents on this machine.

N trainlet processes are the pods of one static job of N nodes, one of
them a spare (`--nnodes N --spares 1`), each with its own loopback address (127.0.X.Y) and one
`sleep` worker; pod 0 serves the store. Once the first round has formed and
the spare waits, one training pod's agent and worker are signalled together
(their session): SIGKILL stands for an agent the OOM killer or a crash took
(no goodbye: the store host reads its closed connection), SIGTERM for a
deleted pod. The time is from the signal to the store host's "round formed"
of the next round, in which the spare holds the lost pod's node rank; the
phases between are read from the store host's log.

Usage: python3 benches/lost_pod.py --bin target/.../release/trainlet
           [--pods 4] [--signal kill|term] [--reps 3]

All pods share this machine's CPUs: at hundreds of pods the time includes
every agent's own work of stopping its worker and joining again, which on a
real cluster runs on as many machines.
"""

import argparse
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_env(i: int, port: int) -> dict:
    """Pod i's environment: node rank i, one worker, its own loopback address, the store at `port`."""
    return dict(
        os.environ,
        PET_NPROC_PER_NODE="1",
        PET_NODE_RANK=str(i),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
        PET_LOCAL_ADDR=f"127.0.{i // 250}.{i % 250 + 1}",
        TRAINLET_LOG="info",
    )


def stamp(line: str) -> float:
    """The time of a tracing line (`2026-12-03T17:49:43.747020Z ...`)."""
    return datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()


def proc_stats(pid: int) -> tuple[float, float]:
    """Peak RSS (MB) and CPU seconds of a live process."""
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return hwm / 1024, (int(fields[11]) + int(fields[12])) / ticks


def once(args, sig) -> dict:
    port, d = free_port(), tempfile.mkdtemp(prefix="lost-pod-")
    n = args.pods
    pods, logs = [], [f"{d}/{i}.err" for i in range(n)]
    try:
        for i in range(n):
            env = pod_env(i, port)
            with open(logs[i], "w") as err:
                pods.append(
                    subprocess.Popen(
                        [args.bin, "run", "--nnodes", str(n), "--spares", "1", "--max-restarts", "0",
                         "--no-python", "sleep", "600"],
                        env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                    )
                )
        read = lambda i: open(logs[i]).read()
        started, spare = time.time(), None
        while spare is None or "round formed" not in read(0):
            if time.time() - started > args.timeout:
                sys.exit(f"no first round with a waiting spare in {args.timeout} s; logs in {d}")
            spare = spare if spare is not None else next(
                (i for i in range(1, n) if "waiting as a spare" in read(i)), None)
            time.sleep(0.1)
        first_round = time.time() - started
        time.sleep(2.0)  # the round settles: workers up, heartbeats beating
        victim = next(i for i in range(1, n) if i != spare)
        before = read(0).count("round formed")
        agents_cpu = lambda: sum(proc_stats(p.pid)[1] for i, p in enumerate(pods) if i != victim and p.poll() is None)
        cpu_before = agents_cpu()
        signalled = time.time()
        os.killpg(pods[victim].pid, sig)
        while read(0).count("round formed") == before:
            if time.time() - signalled > args.timeout:
                sys.exit(f"no round after the {sig.name} in {args.timeout} s; logs in {d}")
            time.sleep(0.005)
        took = time.time() - signalled
        agents_cpu_s = agents_cpu() - cpu_before
        rss, cpu = proc_stats(pods[0].pid)
        host = [l for l in read(0).splitlines() if l[:4].isdigit()]
        after = [l for l in host if stamp(l) >= signalled - 0.01]
        phase = lambda pat: next((stamp(l) - signalled for l in after if re.search(pat, l)), float("nan"))
        return {
            "took": took,
            "ended": phase(r"the round ended|members' store connections closed|stopped heartbeating"),
            "decided": phase(r"round decided"),
            "first_round": first_round,
            "host_rss_mb": rss,
            "host_cpu_s": cpu,
            "agents_cpu_s": agents_cpu_s,
            "dir": d,
        }
    finally:
        for p in pods:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in pods:
            p.wait()
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the trainlet binary (a release build)")
    ap.add_argument("--pods", type=int, default=4, help="pods in all, the spare included (>= 3)")
    ap.add_argument("--signal", choices=["kill", "term"], default="kill")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    ap.add_argument("--keep", action="store_true", help="keep each run's logs (their directory is printed)")
    args = ap.parse_args()
    if args.pods < 3:
        sys.exit("--pods: at least 3 (two training pods and the spare)")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sig = signal.SIGKILL if args.signal == "kill" else signal.SIGTERM
    times = []
    for _ in range(args.reps):
        r = once(args, sig)
        times.append(r["took"])
        print(
            f"{args.pods} pods, SIG{args.signal.upper()}: next round {r['took']:.3f} s after the signal "
            f"(round ended {r['ended']:.3f} s, decided {r['decided']:.3f} s); first round {r['first_round']:.2f} s; "
            f"store host peak RSS {r['host_rss_mb']:.1f} MB, CPU {r['host_cpu_s']:.2f} s; "
            f"the agents' CPU from the signal to the next round {r['agents_cpu_s']:.2f} s"
            + (f"; logs {r['dir']}" if args.keep else ""),
            flush=True,
        )
    print(f"median {statistics.median(times):.3f} s of {len(times)}")


if __name__ == "__main__":
    main()
